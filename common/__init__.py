"""Code shared by the verify and draft services."""
