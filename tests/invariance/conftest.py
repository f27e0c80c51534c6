"""Fixtures of the daemon invariance matrix (defined in matrix_support.py)."""

from matrix_support import reference, streamed_model  # noqa: F401
