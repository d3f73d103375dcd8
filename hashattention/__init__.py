"""HashAttention: learned binary signatures select the KV-cache rows that matter.

``import hashattention`` loads the compiled kernels and registers the operators
``torch.ops.hashattention.*``; :mod:`hashattention.ops` holds their documented wrappers and
:mod:`hashattention.reference` plain-PyTorch versions of each, used as the test oracle.
"""

import torch  # noqa: F401  (the extension links against torch's libraries: load them first)

from ._library import load_extension

_C = load_extension()

from . import bounds, ops, padding, reference  # noqa: E402
from .adapters import AdapterConfig, HashAdapters  # noqa: E402
from .config import HashAttentionConfig  # noqa: E402
from .ops import (  # noqa: E402
    encode_pair_and_select,
    encode_signatures,
    encode_signatures_pair,
    encode_signatures_pair_into,
    hamming_scores,
    hamming_topk,
    pack_signs,
    sparse_attention,
    topk_from_scores,
)

__version__ = "0.1.0"


def __getattr__(name):
    # patch / unpatch import transformers (seconds): loaded on first use, not with the ops.
    if name in ("patch", "unpatch", "is_patched"):
        from . import patching

        return getattr(patching, name)
    if name == "GenerationOptions":
        from .generation import GenerationOptions

        return GenerationOptions
    raise AttributeError(f"module 'hashattention' has no attribute {name!r}")


#: True when the CUDA kernels were compiled into the extension.
WITH_CUDA: bool = bool(_C.with_cuda)

__all__ = [
    "AdapterConfig",
    "GenerationOptions",
    "HashAdapters",
    "HashAttentionConfig",
    "is_patched",
    "patch",
    "unpatch",
    "encode_pair_and_select",
    "encode_signatures",
    "encode_signatures_pair",
    "encode_signatures_pair_into",
    "hamming_scores",
    "hamming_topk",
    "ops",
    "pack_signs",
    "reference",
    "sparse_attention",
    "topk_from_scores",
    "WITH_CUDA",
]
