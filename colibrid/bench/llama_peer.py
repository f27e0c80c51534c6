"""llama.cpp as the peer runtime: the optional module and the two calls both peer benches
need beyond llama-cpp-python's API (`colibri bench peer`, in-process, and its `--far`
side-by-side, in a child process).

They live here, below both benches, so that neither bench module imports the other's
internals: `peer` runs `peer_far`, and `peer_far` once imported these back from `peer`, a
cycle hidden in functions (tests/test_layering.py fails on such cycles). llama.cpp comes
from the optional extra `colibri[peer]` and is never a test dependency, so it is imported
only when a bench runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from colibrid.errors import ConfigError

PEER_VERSION = "0.3.36"
INSTALL = (
    f"llama.cpp is not installed: CMAKE_ARGS='-DGGML_NATIVE=ON' pip install "
    f"'llama-cpp-python=={PEER_VERSION}' (or the extra colibri[peer])"
)


def llama_cpp_module():  # noqa: ANN201 - the optional module
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(INSTALL) from None
    return llama_cpp


@contextlib.contextmanager
def no_repack(llama_cpp) -> Iterator[None]:  # noqa: ANN001
    """Models loaded meanwhile keep their weights in the mapped file (llama.cpp's
    `--no-repack`): repacking copies them into RAM, which a model bigger than RAM has not.
    llama-cpp-python has no argument for it, so its default parameters are wrapped."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params():  # noqa: ANN202
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def last_logits(llm) -> np.ndarray:  # noqa: ANN001
    """The logits of the last token evaluated. (`Llama.scores` is only filled with
    logits_all, which makes every prompt token compute the head too.)"""
    llama_cpp = llama_cpp_module()
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))
