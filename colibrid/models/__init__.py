"""Model families, one module per config.json `model_type`, sharing blocks in layers/.

`family(model_type)` finds the module; an unknown architecture is refused by name.
`mtp_loader(model_type)` is the family's loader of its MTP layer, for the families that
build one (the MLA families: GLM-5.x, DeepSeek-V3 and V3.2), else None.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

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


MTP_FAMILIES = ("glm_moe_dsa", "deepseek_v3", "deepseek_v32")  # built by models/deepseek_v3.py


def mtp_loader(model_type: object) -> Callable[..., Any] | None:
    """`load_mtp(args, src, experts, ops)` of `model_type`'s family, when it builds an MTP
    layer (validation loads it without ops, to check its tensors), else None."""
    if model_type not in MTP_FAMILIES:
        return None
    from colibrid.models.deepseek_v3 import load_mtp

    return load_mtp
