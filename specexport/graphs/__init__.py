"""specexport.graphs."""
