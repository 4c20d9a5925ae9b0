"""Runnable examples (installed with the package)."""
