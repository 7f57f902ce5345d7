"""specexport runtime: loads an artifact and runs exact speculative decoding."""
