"""The one place that reads transformers' private API, behind a version check.

`parallelize`'s attention calls into transformers' own modeling code, through names that are not its public API
and may change in any release:

    name                                       read for
    <family module>.apply_rotary_pos_emb       rotary on this rank's q, k (the family's own formula)
    <family module>.eager_attention_forward    the fallback of the attention interface
    ALL_ATTENTION_FUNCTIONS.get_interface      transformers' attention function (its masks, windows, dropout)
    config._attn_implementation                which one the model was loaded with ("sdpa", "eager", ...)

The range tested (setup.py's `hf` extra pins the same) is SUPPORTED; another version raises an ImportError that
names it and the range, at the first call, not at import (importing parallel_attention never imports transformers).
"""

from __future__ import annotations

import sys
from typing import Callable

from torch import nn

SUPPORTED = (5, 6)  # >= 5.0, < 6: 5.x renamed rope_scaling to rope_parameters and torch_dtype to dtype
_checked: list[str] = []


def _major_minor(version: str) -> tuple[int, int]:
    parts = (version.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)


def check_version(version: str | None = None) -> None:
    """ImportError unless `version` (default: the installed transformers') is in SUPPORTED (checked once)."""
    if _checked and version is None:
        return
    if version is None:
        import transformers

        version = transformers.__version__
    if not SUPPORTED[0] <= _major_minor(version)[0] < SUPPORTED[1]:
        raise ImportError(f"parallelize reads transformers' attention internals and supports transformers>="
                          f"{SUPPORTED[0]}.0,<{SUPPORTED[1]}, but {version} is installed: "
                          f"pip install 'transformers>={SUPPORTED[0]}.0,<{SUPPORTED[1]}'.")
    _checked.append(version)


def family_functions(attention: nn.Module) -> tuple[Callable, Callable]:
    """(apply_rotary_pos_emb or None, eager_attention_forward) of the modeling file that defines `attention`."""
    check_version()
    module = sys.modules[type(attention).__module__]
    return getattr(module, "apply_rotary_pos_emb", None), module.eager_attention_forward


def attn_implementation(config) -> str:
    """The attention implementation the model was loaded with."""
    return config._attn_implementation


def attention_function(config, eager: Callable) -> Callable:
    """transformers' attention function for the model's implementation (`eager` for "eager")."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation(config), eager)
