"""colibri: the light command-line clients (they import no numpy)."""

__version__ = "0.1.0"
