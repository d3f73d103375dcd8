"""encode_pair_and_select: a decode step's selection from the query rows, with the new keys stored.

Its three outputs and the cache must equal encode_signatures_pair_into followed by hamming_topk bit for
bit (the pair's kernels are checked against the float64 reference in test_encode_pair*), and the
selection must equal the reference's hamming_topk on the returned query signatures and the written
cache, on every selection mode (per query head, group-shared), with ragged lengths, left padding and
per-sequence budgets. Bad arguments fail with the component ops' messages.
"""

import pytest
import torch

import hashattention as ha
from op_helpers import generator_for, random_lengths, random_signatures
from encoder_helpers import make_mlp, strided

ERRORS = (RuntimeError, TypeError, ValueError)  # TORCH_CHECK, TORCH_CHECK_TYPE, TORCH_CHECK_VALUE

# batch, query heads, KV heads, key-MLP heads, selection heads, keys (cache slots), D, hidden, bits
CASES = [
    (1, 8, 2, 8, 8, 300, 64, (64,), 32),  # per query head, key MLPs over KV-head keys
    (3, 8, 2, 8, 2, 257, 64, (32,), 32),  # group-shared selection over per-query-head signatures
    (2, 4, 4, 4, 4, 96, 128, (128, 128), 64),  # the paper's MLP, two words
    (2, 8, 2, 2, 2, 1000, 64, (32,), 32),  # per-KV-head key MLPs (group-shared mode of the package)
]


def step_inputs(case, dtype, device, g):
    """A decode step's query row, new key, both MLP stacks and the new key's cache slot (the last)."""
    batch, hq, hkv, hk, hs, slots, dim, hidden, bits = case
    query = strided(batch, hq, 1, dim, g, dtype, device)
    key = strided(batch, hkv, 1, dim, g, dtype, device)
    qw, qb = make_mlp(hq, [dim, *hidden, bits], g, dtype, device)
    kw, kb = make_mlp(hk, [dim, *hidden, bits], g, dtype, device)
    return query, key, qw, qb, kw, kb, torch.tensor([slots - 1], device=device)


def run_case(case, dtype, device, ragged, budgets_on):
    batch, hq, hkv, hk, hs, slots, dim, hidden, bits = case
    g = generator_for("pair-and-select", case, dtype, device, ragged, budgets_on)
    query, key, qw, qb, kw, kb, position = step_inputs(case, dtype, device, g)
    lengths, starts = random_lengths(batch, slots, g, ragged)
    lengths, starts = lengths.clamp(min=1).to(device), starts.to(device)
    starts = torch.minimum(starts, lengths - 1)
    budgets = torch.randint(0, slots, (batch,), generator=g).to(torch.int32).to(device) if budgets_on else None
    cache = random_signatures((batch, hk, slots, bits // 32), g, device)
    selection = dict(selection_heads=hs, sink_tokens=4, local_tokens=8, budget_tokens=slots // 8,
                     lengths=lengths, start_positions=starts, budgets=budgets)

    got_cache = cache.clone()
    indices, counts, q_sig = ha.encode_pair_and_select(query, qw, qb, key, kw, kb, got_cache, position,
                                                       activation="silu", **selection)
    want_cache = cache.clone()
    want_q = ha.encode_signatures_pair_into(query, qw, qb, key, kw, kb, want_cache, position, "silu")
    want_indices, want_counts = ha.hamming_topk(want_q, want_cache, **selection)
    assert torch.equal(q_sig, want_q), "query signatures differ from encode_signatures_pair_into's"
    assert torch.equal(got_cache, want_cache), "the cache differs from encode_signatures_pair_into's"
    assert torch.equal(indices, want_indices) and torch.equal(counts, want_counts), "selection differs"
    ref_indices, ref_counts = ha.reference.hamming_topk(q_sig.cpu(), got_cache.cpu(), **{
        k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in selection.items()})
    assert torch.equal(indices.cpu(), ref_indices) and torch.equal(counts.cpu(), ref_counts.to(counts.dtype)), \
        "selection differs from the reference"
    # The new key's row was written (a fresh random cache word equals the signature with chance 2^-32).
    assert not torch.equal(got_cache[:, :, slots - 1], cache[:, :, slots - 1])
    assert torch.equal(got_cache[:, :, : slots - 1], cache[:, :, : slots - 1])


@pytest.mark.parametrize("budgets_on", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[str(c[:6]) for c in CASES])
def test_matches_the_two_ops_and_the_reference(device, case, dtype, ragged, budgets_on):
    run_case(case, dtype, device, ragged, budgets_on)


def test_compiles_without_graph_breaks(device):
    """Under torch.compile the op is one opaque node (its fake kernel gives the shapes); the cache is
    written in place."""
    case = CASES[1]
    batch, hq, hkv, hk, hs, slots, dim, hidden, bits = case
    g = generator_for("pair-and-select-compile", device)
    query, key, qw, qb, kw, kb, position = step_inputs(case, torch.float32, device, g)
    cache = random_signatures((batch, hk, slots, 1), g, device)

    def step(q, k, c):
        indices, counts, _ = ha.encode_pair_and_select(q, qw, qb, k, kw, kb, c, position, selection_heads=hs,
                                                       sink_tokens=4, local_tokens=8, budget_tokens=16)
        return indices, counts

    eager_cache, compiled_cache = cache.clone(), cache.clone()
    want = step(query, key, eager_cache)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(query, key, compiled_cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(compiled_cache, eager_cache)


def test_bad_arguments_name_them(device):
    case = CASES[0]
    batch, hq, hkv, hk, hs, slots, dim, hidden, bits = case
    g = generator_for("pair-and-select-bad", device)
    query, key, qw, qb, kw, kb, position = step_inputs(case, torch.float32, device, g)
    cache = random_signatures((batch, hk, slots, 1), g, device)
    with pytest.raises(ERRORS, match="positions"):
        ha.encode_pair_and_select(query, qw, qb, key, kw, kb, cache, position.float(), selection_heads=hs,
                                  sink_tokens=4, local_tokens=8, budget_tokens=16)
    with pytest.raises(ERRORS, match="selection_heads"):
        ha.encode_pair_and_select(query, qw, qb, key, kw, kb, cache, position, selection_heads=3,
                                  sink_tokens=4, local_tokens=8, budget_tokens=16)
    if device != "cpu":
        return  # device values (lengths) are checked on the CPU only: a CUDA check would need a host sync
    with pytest.raises(ERRORS, match="lengths"):
        ha.encode_pair_and_select(query, qw, qb, key, kw, kb, cache, position, selection_heads=hs,
                                  sink_tokens=4, local_tokens=8, budget_tokens=16,
                                  lengths=torch.full((batch,), slots + 1, dtype=torch.int32, device=device))
