"""Oracle-local pytest configuration: the `sweep` marker (`pytest -m sweep` selects the config
sweep; `COLIBRI_SWEEP_COUNT=N` adds N more drawn configs per architecture)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "sweep: config-sweep oracle cases (COLIBRI_SWEEP_COUNT=N draws N more)"
    )
