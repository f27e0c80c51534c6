"""Model families, one module per config.json `model_type`, sharing blocks in layers/.

`family(model_type)` finds the module; an unknown architecture is refused by name.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from colibrid.errors import ModelLoadError

SUPPORTED = (
    "glm_moe_dsa",
    "deepseek_v32",
    "glm4_moe",
    "deepseek_v3",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
)


def family(model_type: object) -> ModuleType:
    """The module implementing `model_type` (it provides ModelArgs and build)."""
    if model_type not in SUPPORTED:
        raise ModelLoadError(
            f"unsupported architecture model_type={model_type!r}; colibri runs "
            f"{', '.join(SUPPORTED)}",
            code="UNKNOWN_ARCH",
        )
    return importlib.import_module(f"colibrid.models.{model_type}")
