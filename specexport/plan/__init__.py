"""specexport.plan."""
