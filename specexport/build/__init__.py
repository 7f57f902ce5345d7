"""specexport.build."""
