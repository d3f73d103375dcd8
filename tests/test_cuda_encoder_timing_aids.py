"""The decode-step encoder's timing aid and the one-launch encode_pair_and_select (CUDA only).

HASHATTENTION_ENCODER=skip launches nothing (the key cache is left as it was). With
HASHATTENTION_FUSED_SELECTION=1, encode_pair_and_select's selection computes the query signatures and the
new key's from the MLPs itself (query_mlp_prologue.cuh); they must match the two-launch path's, and the
selection with them, and a selection that cannot take the one-launch path must fall back.
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


@pytest.mark.parametrize("local_tokens", [128, 0])
@pytest.mark.parametrize("activation", ["silu", "relu"])
@pytest.mark.parametrize("batch,keys", [(1, 8192), (2, 40000), (4, 131200)])
def test_fused_selection_matches_the_two_launches(monkeypatch, activation, batch, keys, local_tokens):
    """encode_pair_and_select with HASHATTENTION_FUSED_SELECTION=1 (the selection computes the query and
    new-key signatures itself) against the same op in two launches. Without a local window the first
    sequence's new key is one of its candidates, so the selection must score its new signature."""
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + keys)
    q_mlp, k_mlp = _mlp(g), _mlp(g)
    query = torch.randn(batch, HEADS, 1, D, generator=g, device="cuda").bfloat16()
    key = torch.randn(batch, 8, 1, D, generator=g, device="cuda").bfloat16()
    signatures = torch.randint(-2**31, 2**31 - 1, (batch, HEADS, keys, 1), generator=g, device="cuda",
                               dtype=torch.int32)
    lengths = torch.full((batch,), keys - 3, device="cuda", dtype=torch.int32)
    lengths[0] = keys if local_tokens == 0 else keys // 2
    positions = torch.tensor([keys - 1], device="cuda")
    # The last sequence gets no heavy budget: its rows need no scores but still return query signatures.
    budgets = torch.full((batch,), keys // 32, device="cuda", dtype=torch.int32)
    budgets[-1] = 0 if batch > 1 else budgets[-1]

    def step(cache):
        return ops.encode_pair_and_select(query, *q_mlp, key, *k_mlp, cache, positions, activation=activation,
                                          selection_heads=HEADS, sink_tokens=128, local_tokens=local_tokens,
                                          budget_tokens=keys // 32, lengths=lengths, budgets=budgets)

    monkeypatch.delenv("HASHATTENTION_FUSED_SELECTION", raising=False)
    expected_cache, fused_cache = signatures.clone(), signatures.clone()
    want_indices, want_counts, want_q = step(expected_cache)
    monkeypatch.setenv("HASHATTENTION_FUSED_SELECTION", "1")
    got_indices, got_counts, got_q = step(fused_cache)
    torch.cuda.synchronize()

    def differing_bits(a, b):
        return sum(bin(x & 0xFFFFFFFF).count("1") for x in torch.bitwise_xor(a, b).view(-1).tolist())

    # Float32 sums in another order: a bit may flip where an MLP output is within rounding of zero.
    differing = differing_bits(got_q, want_q)
    assert differing <= max(2, got_q.numel() * 32 // 200), f"{differing} of {got_q.numel() * 32} query bits differ"
    slot = int(positions[0])
    assert torch.equal(fused_cache[:, :, :slot], signatures[:, :, :slot])  # only the new key's slot is written
    differing = differing_bits(fused_cache[:, :, slot], expected_cache[:, :, slot])
    assert differing <= max(2, batch * HEADS * 32 // 200), f"{differing} key bits differ"
    # Rows compared where both signatures agree (a flipped bit changes the selection legitimately).
    rows_equal = ((got_q == want_q).view(batch, HEADS) & (fused_cache[:, :, slot] == expected_cache[:, :, slot]).view(batch, HEADS))
    assert rows_equal.float().mean() >= 0.9
    for b in range(batch):
        for h in range(HEADS):
            if rows_equal[b, h]:
                assert torch.equal(got_indices[b, h], want_indices[b, h]), (b, h)
                assert torch.equal(got_counts[b, h], want_counts[b, h]), (b, h)


def test_fused_selection_falls_back_when_the_grid_is_not_resident(monkeypatch):
    """A selection that takes the two-launch chunked path cannot compute signatures: the op redoes the
    step in two launches and gives the same result."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q_mlp, k_mlp = _mlp(g), _mlp(g)
    query = torch.randn(2, HEADS, 1, D, generator=g, device="cuda").bfloat16()
    key = torch.randn(2, 8, 1, D, generator=g, device="cuda").bfloat16()
    signatures = torch.randint(-2**31, 2**31 - 1, (2, HEADS, 20000, 1), generator=g, device="cuda", dtype=torch.int32)
    positions = torch.tensor([19999], device="cuda")
    outputs = []
    for fused in ("0", "1"):
        monkeypatch.setenv("HASHATTENTION_FUSED_SELECTION", fused)
        monkeypatch.setenv("HASHATTENTION_SELECTION", "chunked")
        cache = signatures.clone()
        outputs.append((*ops.encode_pair_and_select(query, *q_mlp, key, *k_mlp, cache, positions,
                                                    selection_heads=HEADS, sink_tokens=16, local_tokens=16,
                                                    budget_tokens=600), cache))
    for want, got in zip(outputs[0], outputs[1]):
        assert torch.equal(want, got)
