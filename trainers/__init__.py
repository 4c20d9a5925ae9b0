"""Command-line trainers (``sparta-train``)."""
