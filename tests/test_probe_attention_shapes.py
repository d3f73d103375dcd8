"""scripts/probe_attention.py: a launch shape names exactly the timing aids it sets (CPU only)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import probe_attention as pa  # noqa: E402


@pytest.mark.parametrize("shape, expected", [
    ("default", {}),
    ("4:128", {"HASHATTENTION_ATTENTION_BLOCKS_PER_SM": "4", "HASHATTENTION_ATTENTION_MIN_ROWS": "128"}),
    ("default/c0", {"HASHATTENTION_ATTENTION_CLUSTER": "0"}),
    ("2:32/c16", {"HASHATTENTION_ATTENTION_BLOCKS_PER_SM": "2", "HASHATTENTION_ATTENTION_MIN_ROWS": "32",
                  "HASHATTENTION_ATTENTION_CLUSTER": "16"}),
])
def test_shapes_set_their_timing_aids(shape, expected):
    assert pa.shape_environment(shape) == expected


@pytest.mark.parametrize("shape", ["4", "4:x", "fast", "default/c", "default/x1", "default/c1/c2", "default/m1"])
def test_malformed_shapes_are_named(shape):
    with pytest.raises(ValueError, match=f"shape {shape!r}"):
        pa.shape_environment(shape)
