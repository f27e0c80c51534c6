"""colibrid: the daemon side of colibri — models, engine, expert store, kernels."""

__version__ = "0.1.0"
