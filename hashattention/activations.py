"""The activations a signature MLP may apply between its layers, by name.

The C++ and CUDA encoders implement the same names (``csrc/mlp_activation.h``); the training
forward of :class:`hashattention.adapters.HeadwiseMLP` uses these PyTorch functions, so an
adapter trained in float encodes to the same signs through the ops.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATION_FUNCTIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU, as torch.nn.GELU() by default
    "tanh": torch.tanh,
    "identity": lambda h: h,
}

#: The names the ops accept for ``activation``.
ACTIVATIONS = tuple(ACTIVATION_FUNCTIONS)
