"""Compute backends. The CPU backend (native C kernels through cffi) is always present."""
