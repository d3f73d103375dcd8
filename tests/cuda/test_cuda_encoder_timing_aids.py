"""HASHATTENTION_ENCODER=skip (CUDA only, for timing a decode step without its encoder):
encode_signatures_pair_into launches nothing, so the key cache is left as it was.
"""
import pytest
import torch

from hashattention import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, D = 32, 128


def _mlp(g: torch.Generator, widths=(128, 128, 128, 32)):
    weights = [torch.randn(HEADS, i, o, generator=g, device="cuda") / i**0.5 for i, o in zip(widths[:-1], widths[1:])]
    biases = [0.1 * torch.randn(HEADS, o, generator=g, device="cuda") for o in widths[1:]]
    return [w.bfloat16() for w in weights], [b.bfloat16() for b in biases]


def _pair_into(query, key, q_mlp, k_mlp, cache, positions, activation):
    return ops.encode_signatures_pair_into(query, *q_mlp, key, *k_mlp, cache, positions, activation)


def test_skip_leaves_the_key_cache_unwritten(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    q_mlp, k_mlp = _mlp(g), _mlp(g)
    query = torch.randn(2, HEADS, 1, D, generator=g, device="cuda").bfloat16()
    key = torch.randn(2, 8, 1, D, generator=g, device="cuda").bfloat16()
    cache = torch.randint(-2**31, 2**31 - 1, (2, HEADS, 64, 1), generator=g, device="cuda", dtype=torch.int32)
    before = cache.clone()
    monkeypatch.setenv("HASHATTENTION_ENCODER", "skip")
    out = _pair_into(query, key, q_mlp, k_mlp, cache, torch.tensor([5], device="cuda"), "silu")
    torch.cuda.synchronize()
    assert out.shape == (2, HEADS, 1, 1)
    assert torch.equal(cache, before)
