"""specexport.bench."""
