"""specexport.recipe."""
