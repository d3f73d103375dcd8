"""The attention launched programmatically after the selection (sm_90) reads this step's indices, the
selection, launched programmatically too, reads this step's signatures, and the encoder, launched so
as well, reads this step's inputs and weights.

`sparse_attention` may start while the selection before it is still writing (programmatic dependent
launch, csrc/cuda/programmatic_launch.cuh), and the one-launch `hamming_topk` while the kernel that
wrote its signatures still runs: their blocks must wait for those grids before their first
read. A missing or misplaced wait shows as attention over the previous step's indices, or over a
half-written list. Each step here draws new signatures, so consecutive selections differ, and the
attention is checked against the float64 reference over the indices the step itself selected.
Skipped without a GPU.
"""

import pytest
import torch

import hashattention as ha
from hashattention import reference
from op_helpers import ATTENTION_TOLERANCE, assert_close_verbose, capture_cuda_graph, generator_for, random_signatures
from encoder_helpers import make_mlp

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ha.WITH_CUDA), reason="needs a GPU and the CUDA kernels"
)


def check_step(indices, counts, out, lse, query, key_cache, value_cache, q_sig, k_sig, selection, what):
    """The step's selection equals the reference's, and its attention is attention over it."""
    expected_indices, expected_counts = selection(q_sig.cpu(), k_sig.cpu(), reference.hamming_topk)
    assert torch.equal(indices.cpu(), expected_indices.to(indices.dtype)), f"{what}: indices"
    assert torch.equal(counts.cpu(), expected_counts.to(counts.dtype)), f"{what}: counts"
    ref_out, ref_lse = reference.sparse_attention(query.cpu(), key_cache.cpu(), value_cache.cpu(), indices.cpu(),
                                                  counts.cpu(), scale=query.shape[-1] ** -0.5)
    assert_close_verbose(out, ref_out, what=f"{what} out", **ATTENTION_TOLERANCE[query.dtype])
    assert_close_verbose(lse, ref_lse, what=f"{what} lse", atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("programmatic", ["1", "0"])
@pytest.mark.parametrize("query_heads,group_shared,keys", [(32, False, 40000), (8, False, 3000), (32, True, 40000)])
@pytest.mark.parametrize("captured", [False, True])
def test_attention_after_selection_reads_this_steps_indices(monkeypatch, programmatic, query_heads, group_shared,
                                                             keys, captured):
    """Eager and graph-replayed steps (B = 1, the splits merged in a cluster at these sizes), with the
    programmatic launch on and off (HASHATTENTION_PROGRAMMATIC_LAUNCH)."""
    monkeypatch.setenv("HASHATTENTION_PROGRAMMATIC_LAUNCH", programmatic)
    kv_heads, head_dim, dtype, steps = 8 if query_heads == 32 else 2, 128, torch.bfloat16, 6
    selection_heads = kv_heads if group_shared else query_heads
    g = generator_for("programmatic", programmatic, query_heads, group_shared, keys, captured)
    q_sig = torch.empty(1, query_heads, 1, 1, dtype=torch.int32, device="cuda")
    k_sig = torch.empty(1, kv_heads if group_shared else query_heads, keys, 1, dtype=torch.int32, device="cuda")
    query = torch.randn(1, query_heads, 1, head_dim, generator=g).to(dtype).cuda()
    key_cache = torch.randn(1, kv_heads, keys, head_dim, generator=g).to(dtype).cuda()
    value_cache = torch.randn(1, kv_heads, keys, head_dim, generator=g).to(dtype).cuda()
    k_sig.copy_(random_signatures(k_sig.shape, g))

    def selection(qs, ks, op=ha.hamming_topk):
        return op(qs, ks, selection_heads=selection_heads, sink_tokens=64, local_tokens=64, budget_tokens=keys // 32)

    def step():
        indices, counts = selection(q_sig, k_sig)
        out, lse = ha.sparse_attention(query, key_cache, value_cache, indices, counts, scale=head_dim**-0.5)
        return indices, counts, out, lse

    if captured:
        graph, outputs = capture_cuda_graph(step)
    # New signatures each step, written by kernels (an elementwise XOR on the device) right before the
    # selection, which is itself launched programmatically: it must wait for them before reading.
    key_base = random_signatures(k_sig.shape, g).cuda()
    for s in range(steps):
        q_sig.copy_(random_signatures(q_sig.shape, g))
        key_flips = random_signatures(k_sig.shape, g).cuda()
        torch.bitwise_xor(key_base, key_flips, out=k_sig)
        if captured:
            graph.replay()
        else:
            outputs = step()
        torch.cuda.synchronize()
        check_step(*outputs, query, key_cache, value_cache, q_sig, k_sig, selection, f"step {s}")


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("op", ["single", "pair_into"])
@pytest.mark.parametrize("encoder,batch", [("fma", 1), ("fma", 4), ("mma", 8), ("cluster2", 4), ("cluster4", 1)])
def test_encoder_reads_this_steps_inputs_and_weights(monkeypatch, encoder, batch, op, captured):
    """The encoder's blocks may start while the kernel before them runs, and warm L2 with their
    weights before waiting for it. Each step a kernel right before the encoder (inside the graph
    when captured) writes new inputs and new weights -- the last layer negated every other step,
    which flips every signature bit a stale read would keep -- and the output (with the pair, also
    the selection launched right after it over the stored signatures) must equal the same kernels'
    launched without the overlap (HASHATTENTION_PROGRAMMATIC_LAUNCH=0) after a sync."""
    monkeypatch.setenv("HASHATTENTION_ENCODER", encoder)
    heads, kv_heads, sizes, dtype = 32, 8, [128, 128, 128, 32], torch.bfloat16
    g = generator_for("programmatic-encoder", encoder, batch, op, captured)
    query = torch.empty(batch, heads, 1, sizes[0], dtype=dtype, device="cuda")
    key = torch.empty(batch, kv_heads, 1, sizes[0], dtype=dtype, device="cuda")
    qw, qb = make_mlp(heads, sizes, g, dtype, "cuda")
    kw, kb = make_mlp(heads, sizes, g, dtype, "cuda")
    cache = torch.zeros(batch, heads, 12, 1, dtype=torch.int32, device="cuda")
    positions = torch.tensor([5], device="cuda")
    # Sources the step copies from (device kernels right before the encoder).
    query_src, key_src = torch.empty_like(query), torch.empty_like(key)
    last_q_src, last_k_src = qw[-1].clone(), kw[-1].clone()

    def encode():
        if op == "single":
            return (ha.encode_signatures(query, qw, qb),)
        # The selection right after the encoder (as in a decode step) may be placed before the encoder
        # finishes; it must read this step's query signatures and the key signatures just stored.
        query_signatures = ha.encode_signatures_pair_into(query, qw, qb, key, kw, kb, cache, positions)
        indices, counts = ha.hamming_topk(query_signatures, cache, selection_heads=heads, sink_tokens=2,
                                          local_tokens=2, budget_tokens=4)
        return query_signatures, indices, counts

    def step():
        query.copy_(query_src)
        key.copy_(key_src)
        qw[-1].copy_(last_q_src)
        kw[-1].copy_(last_k_src)
        return encode()

    for s in range(5):
        query_src.copy_(torch.randn(query.shape, generator=g).to(dtype))
        key_src.copy_(torch.randn(key.shape, generator=g).to(dtype))
        last_q_src.neg_()
        last_k_src.neg_()
        cache.zero_()
        if captured and s == 0:
            graph, out = capture_cuda_graph(step)
            cache.zero_()
        if captured:
            graph.replay()
        else:
            out = step()
        torch.cuda.synchronize()
        got, got_cache = [t.clone() for t in out], cache.clone()
        monkeypatch.setenv("HASHATTENTION_PROGRAMMATIC_LAUNCH", "0")
        cache.zero_()
        want = encode()
        torch.cuda.synchronize()
        monkeypatch.delenv("HASHATTENTION_PROGRAMMATIC_LAUNCH")
        for name, g_t, w_t in zip(("query signatures", "indices", "counts"), got, want):
            assert torch.equal(g_t, w_t), f"step {s}: {name}"
        assert torch.equal(got_cache, cache), f"step {s}: stored key signatures"


def test_bad_programmatic_launch_value_is_named(monkeypatch):
    """HASHATTENTION_PROGRAMMATIC_LAUNCH accepts 0 or 1 only, and says so."""
    monkeypatch.setenv("HASHATTENTION_PROGRAMMATIC_LAUNCH", "yes")
    q = torch.randn(1, 4, 1, 64, device="cuda")
    k = torch.randn(1, 4, 300, 64, device="cuda")
    indices = torch.arange(200, dtype=torch.int32, device="cuda").expand(1, 4, 1, 200).contiguous()
    with pytest.raises(RuntimeError, match="HASHATTENTION_PROGRAMMATIC_LAUNCH must be 0 or 1"):
        ha.sparse_attention(q, k, k, indices, scale=0.125)
