"""specexport.train."""
