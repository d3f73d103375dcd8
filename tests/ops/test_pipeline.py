"""The whole decode pipeline: encode -> select -> sparse attention.

With a budget >= the sequence length it must equal dense causal attention; at small budgets
it must equal the reference pipeline (exact selection, outputs to tolerance). It must also
trace under torch.compile(fullgraph=True).
"""

import pytest
import torch
import torch.nn.functional as F

import hashattention as ha
from hashattention import reference
from op_helpers import ATTENTION_TOLERANCE, assert_close_verbose, generator_for


def make_inputs(g, batch, query_heads, kv_heads, rows, keys, head_dim, dtype, key_heads, bits=32):
    q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    mlp = []
    for heads in (query_heads, key_heads):
        w = [torch.randn(heads, head_dim, 64, generator=g) / head_dim**0.5, torch.randn(heads, 64, bits, generator=g) / 8]
        b = [torch.randn(heads, 64, generator=g) * 0.1, torch.randn(heads, bits, generator=g) * 0.1]
        mlp.append((w, b))
    return q, k, v, mlp


def run_pipeline(ops, q, k, v, mlp, key_heads, selection_heads, sink, local, budget, lengths, starts, scale):
    (qw, qb), (kw, kb) = mlp
    keys_per_head = k if key_heads == k.shape[1] else k.repeat_interleave(key_heads // k.shape[1], dim=1)
    q_sig = ops.encode_signatures(q, qw, qb)
    k_sig = ops.encode_signatures(keys_per_head, kw, kb)
    indices, counts = ops.hamming_topk(q_sig, k_sig, selection_heads=selection_heads, sink_tokens=sink,
                                       local_tokens=local, budget_tokens=budget, lengths=lengths,
                                       start_positions=starts)
    return ops.sparse_attention(q, k, v, indices, counts, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_heads,kv_heads,group_shared", [(4, 4, False), (8, 2, True), (9, 3, False)])
@pytest.mark.parametrize("rows", [1, 5])
def test_full_budget_equals_dense_causal_attention(device, dtype, query_heads, kv_heads, group_shared, rows):
    g = generator_for("full-budget", device, dtype, query_heads, kv_heads, group_shared, rows)
    batch, keys, head_dim = 3, 333, 64
    key_heads = kv_heads if group_shared else query_heads
    selection_heads = kv_heads if group_shared else query_heads
    q, k, v, mlp = make_inputs(g, batch, query_heads, kv_heads, rows, keys, head_dim, dtype, key_heads)
    lengths = torch.tensor([333, 200, 17], dtype=torch.int32)
    starts = torch.tensor([0, 31, 4], dtype=torch.int32)
    scale = head_dim**-0.5
    to = lambda t: t.to(device)  # noqa: E731
    out, lse = run_pipeline(ha.ops, to(q), to(k), to(v), [[list(map(to, w)), list(map(to, b))] for w, b in mlp],
                            key_heads, selection_heads, 16, 16, keys, to(lengths), to(starts), scale)
    ref_out, ref_lse = reference.dense_causal_attention(q, k, v, scale=scale, lengths=lengths, start_positions=starts)
    assert_close_verbose(out, ref_out, what="full budget vs dense", **ATTENTION_TOLERANCE[dtype])
    assert_close_verbose(lse, ref_lse, what="lse", atol=2e-4, rtol=2e-4)


def test_full_budget_equals_torch_sdpa(device):
    """The same check against torch's own causal SDPA (a decode chunk at the end of the cache)."""
    g = generator_for("sdpa", device)
    batch, query_heads, kv_heads, rows, keys, head_dim = 2, 8, 2, 4, 257, 128
    q, k, v, mlp = make_inputs(g, batch, query_heads, kv_heads, rows, keys, head_dim, torch.float32, query_heads)
    to = lambda t: t.to(device)  # noqa: E731
    out, _ = run_pipeline(ha.ops, to(q), to(k), to(v), [[list(map(to, w)), list(map(to, b))] for w, b in mlp],
                          query_heads, query_heads, 0, 0, keys, None, None, head_dim**-0.5)
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(diagonal=keys - rows)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("group_shared", [False, True])
def test_small_budget_equals_reference_pipeline(device, group_shared):
    g = generator_for("small-budget", device, group_shared)
    batch, query_heads, kv_heads, rows, keys, head_dim = 3, 8, 2, 5, 1500, 128
    key_heads = kv_heads if group_shared else query_heads
    selection_heads = kv_heads if group_shared else query_heads
    q, k, v, mlp = make_inputs(g, batch, query_heads, kv_heads, rows, keys, head_dim, torch.float32, key_heads)
    lengths = torch.tensor([1500, 999, 400], dtype=torch.int32)
    starts = torch.tensor([0, 0, 50], dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    out, lse = run_pipeline(ha.ops, to(q), to(k), to(v), [[list(map(to, w)), list(map(to, b))] for w, b in mlp],
                            key_heads, selection_heads, 32, 32, 64, to(lengths), to(starts), head_dim**-0.5)
    ref_out, ref_lse = run_pipeline(reference, q, k, v, mlp, key_heads, selection_heads, 32, 32, 64, lengths,
                                    starts, head_dim**-0.5)
    assert_close_verbose(out, ref_out, what="small budget", **ATTENTION_TOLERANCE[torch.float32])
    assert_close_verbose(lse, ref_lse, what="lse", atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_pipeline_compiles_fullgraph(device, backend):
    """torch.compile(fullgraph=True) traces the three ops (fake kernels) and matches eager."""
    g = generator_for("compile", device)
    batch, query_heads, kv_heads, rows, keys, head_dim = 2, 4, 2, 1, 200, 64
    q, k, v, mlp = make_inputs(g, batch, query_heads, kv_heads, rows, keys, head_dim, torch.float32, kv_heads)
    to = lambda t: t.to(device)  # noqa: E731
    (qw, qb), (kw, kb) = [[list(map(to, w)), list(map(to, b))] for w, b in mlp]
    q, k, v = to(q), to(k), to(v)
    lengths = to(torch.tensor([200, 150], dtype=torch.int32))

    def step(q, k, v, lengths):
        q_sig = ha.encode_signatures(q, qw, qb)
        k_sig = ha.encode_signatures(k, kw, kb)
        indices, counts = ha.hamming_topk(q_sig, k_sig, selection_heads=kv_heads, sink_tokens=8, local_tokens=8,
                                          budget_tokens=32, lengths=lengths)
        out, lse = ha.sparse_attention(q, k, v, indices, counts, scale=head_dim**-0.5)
        return out * 2.0, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    expected = step(q, k, v, lengths)
    got = compiled(q, k, v, lengths)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    # new lengths, same shapes: no recompilation needed and still correct
    lengths2 = to(torch.tensor([120, 199], dtype=torch.int32))
    torch.testing.assert_close(compiled(q, k, v, lengths2)[0], step(q, k, v, lengths2)[0])
