"""Checkpoint conversion and the quantisation maths of docs/formats.md."""
