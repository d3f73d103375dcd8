"""HASHATTENTION_ENCODER=skip and =fused_query: timing aids of the decode-step encoder (CUDA only).

``skip`` launches nothing (the key cache is left as it was). ``fused_query`` is an experiment: the next
one-launch selection computes its query signatures from the query MLP itself (query_mlp_prologue.cuh)
and writes them into the encoder's output, and the new key's signatures into the cache; they must match
the encoder's, and the selection with them.
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


@pytest.mark.parametrize("activation", ["silu", "relu"])
@pytest.mark.parametrize("batch,keys", [(1, 8192), (2, 40000), (4, 131200)])
def test_fused_query_matches_the_encoder(monkeypatch, activation, batch, keys):
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + keys)
    q_mlp, k_mlp = _mlp(g), _mlp(g)
    query = torch.randn(batch, HEADS, 1, D, generator=g, device="cuda").bfloat16()
    key = torch.randn(batch, 8, 1, D, generator=g, device="cuda").bfloat16()
    signatures = torch.randint(-2**31, 2**31 - 1, (batch, HEADS, keys, 1), generator=g, device="cuda",
                               dtype=torch.int32)
    lengths = torch.full((batch,), keys - 3, device="cuda", dtype=torch.int32)
    lengths[0] = keys // 2
    positions = torch.tensor([keys - 1], device="cuda")
    budget = keys // 32

    def select(query_signatures):
        return ops.hamming_topk(query_signatures, signatures, selection_heads=HEADS, sink_tokens=128,
                                local_tokens=128, budget_tokens=budget, lengths=lengths)

    monkeypatch.delenv("HASHATTENTION_ENCODER", raising=False)
    expected_cache, fused_cache = signatures.clone(), signatures.clone()
    expected_q = _pair_into(query, key, q_mlp, k_mlp, expected_cache, positions, activation)
    expected = select(expected_q)
    monkeypatch.setenv("HASHATTENTION_ENCODER", "fused_query")
    fused_q = _pair_into(query, key, q_mlp, k_mlp, fused_cache, positions, activation)
    fused_q.fill_(0x5A5A5A5A)  # only the selection may write it
    got = select(fused_q)
    torch.cuda.synchronize()
    # Float32 sums in another order: a bit may flip where an output is within rounding of zero.
    def differing_bits(a, b):
        return sum(bin(x & 0xFFFFFFFF).count("1") for x in torch.bitwise_xor(a, b).view(-1).tolist())

    differing = differing_bits(fused_q, expected_q)
    assert differing <= max(2, fused_q.numel() * 32 // 200), f"{differing} of {fused_q.numel() * 32} bits differ"
    slot = int(positions[0])
    assert torch.equal(fused_cache[:, :, :slot], signatures[:, :, :slot])  # only the new key's slot is written
    differing = differing_bits(fused_cache[:, :, slot], expected_cache[:, :, slot])
    assert differing <= max(2, batch * HEADS * 32 // 200), f"{differing} key bits differ"
    rows_equal = (fused_q == expected_q).view(batch, HEADS)
    assert rows_equal.float().mean() >= 0.9
    for b in range(batch):
        for h in range(HEADS):
            if rows_equal[b, h]:
                assert torch.equal(got[0][b, h], expected[0][b, h]), (b, h)
                assert torch.equal(got[1][b, h], expected[1][b, h]), (b, h)
