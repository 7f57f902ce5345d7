"""specexport.models."""
