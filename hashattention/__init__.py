"""HashAttention: learned binary signatures select the KV-cache rows that matter.

``import hashattention`` loads the compiled kernels and registers the operators
``torch.ops.hashattention.*``; :mod:`hashattention.ops` holds their documented wrappers and
:mod:`hashattention.reference` plain-PyTorch versions of each, used as the test oracle.
"""

import torch  # noqa: F401  (the extension links against torch's libraries: load them first)

from ._library import load_extension

_C = load_extension()

from . import ops, reference  # noqa: E402
from .ops import (  # noqa: E402
    encode_signatures,
    hamming_scores,
    hamming_topk,
    pack_signs,
    sparse_attention,
    topk_from_scores,
)

__version__ = "0.1.0"

#: True when the CUDA kernels were compiled into the extension.
WITH_CUDA: bool = bool(_C.with_cuda)

__all__ = [
    "encode_signatures",
    "hamming_scores",
    "hamming_topk",
    "ops",
    "pack_signs",
    "reference",
    "sparse_attention",
    "topk_from_scores",
    "WITH_CUDA",
]
