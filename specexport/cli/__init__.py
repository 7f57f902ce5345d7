"""specexport's command line: `main` (the console script) and the click group `cli` (main.py),
one module per command group."""

from .main import cli, main

__all__ = ["cli", "main"]
