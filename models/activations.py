"""The one activation table: engine names, the HF `hidden_act` spellings they stand for, and
the functions.

`ACTIVATIONS` holds the engine names a spec's `mlp.activation` accepts; `HF_NAMES` maps each
spelling an HF config may use to one of them, so the importer, the MLPs, the MoE experts and
the state mixers all agree on what a name means.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (Nemotron-H's ungated MLPs and experts)."""
    return torch.square(F.relu(x))


# Engine name -> function (silu: SwiGLU, gelu_tanh: GeGLU). Order is the order errors list them in.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "relu2": _relu2,
}

# HF `hidden_act` / `hidden_activation` spelling -> engine name.
HF_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
            "gelu": "gelu", "relu2": "relu2"}


def engine_name(name: str) -> str:
    """The engine name for an engine name or an HF spelling; ValueError if it is neither."""
    if name in ACTIVATIONS:
        return name
    if name in HF_NAMES:
        return HF_NAMES[name]
    raise ValueError(f"activation {name!r} is not supported (one of {sorted({*ACTIVATIONS, *HF_NAMES})})")


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function for an engine name or an HF spelling; ValueError if it is neither."""
    return ACTIVATIONS[engine_name(name)]
