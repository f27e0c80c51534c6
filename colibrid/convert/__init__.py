"""Checkpoint conversion and the quantisation maths of DESIGN.md section 5."""
