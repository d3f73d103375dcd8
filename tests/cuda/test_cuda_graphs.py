"""CUDA-graph capture and replay of every op: replays with new inputs equal eager calls.

The CUDA kernels never read device data on the host and size their workspaces from shapes
only, so one captured graph must stay valid when the signatures, lengths, start offsets,
budgets, counts and KV contents behind its static input buffers change. Skipped without a GPU.
"""

import pytest
import torch

import hashattention as ha
from op_helpers import capture_cuda_graph, generator_for, random_signatures

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ha.WITH_CUDA), reason="needs a GPU and the CUDA kernels"
)


def assert_equal_outputs(got, expected, what):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}[{i}]: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(a, b), f"{what}[{i}]: replay differs from eager ({int((a != b).sum())} elements)"


def assert_replays_match_eager(fill, step, what, replays=3):
    """Capture ``step`` once, then refill its inputs and replay: every replay must equal an eager call."""
    fill()
    graph, static_outputs = capture_cuda_graph(step)
    for replay in range(replays):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        assert_equal_outputs(static_outputs, step(), f"{what} {replay}")


@pytest.mark.parametrize("path", ["auto", "chunked"])
@pytest.mark.parametrize("group_shared", [False, True])
@pytest.mark.parametrize("keys", [3000, 70000])
def test_select_and_attend_graph_replays_with_new_inputs(group_shared, keys, path, monkeypatch):
    """Both selection paths: one cooperative launch ("auto" at these sizes) and two launches."""
    if path == "chunked":
        monkeypatch.setenv("HASHATTENTION_SELECTION", "chunked")
    batch, query_heads, kv_heads, rows, words, head_dim = 2, 8, 2, 2, 1, 128
    selection_heads = kv_heads if group_shared else query_heads
    sink, local, budget = 16, 32, keys // 16
    dtype = torch.bfloat16
    g = generator_for("graph-pipeline", group_shared, keys)
    dev = "cuda"
    q_sig = torch.empty(batch, query_heads, rows, words, dtype=torch.int32, device=dev)
    k_sig = torch.empty(batch, selection_heads if not group_shared else kv_heads, keys, words, dtype=torch.int32,
                        device=dev)
    lengths = torch.empty(batch, dtype=torch.int32, device=dev)
    starts = torch.empty(batch, dtype=torch.int32, device=dev)
    budgets = torch.empty(batch, dtype=torch.int32, device=dev)
    query = torch.empty(batch, query_heads, rows, head_dim, dtype=dtype, device=dev)
    key_cache = torch.empty(batch, kv_heads, keys, head_dim, dtype=dtype, device=dev)
    value_cache = torch.empty_like(key_cache)

    def fill():
        q_sig.copy_(random_signatures(q_sig.shape, g))
        k_sig.copy_(random_signatures(k_sig.shape, g))
        lengths.copy_(torch.randint(keys // 2, keys + 1, (batch,), generator=g, dtype=torch.int32))
        starts.copy_(torch.randint(0, 40, (batch,), generator=g, dtype=torch.int32))
        budgets.copy_(torch.randint(0, budget + 1, (batch,), generator=g, dtype=torch.int32))
        query.copy_(torch.randn(query.shape, generator=g).to(dtype))
        key_cache.copy_(torch.randn(key_cache.shape, generator=g).to(dtype))
        value_cache.copy_(torch.randn(value_cache.shape, generator=g).to(dtype))

    def step():
        indices, counts = ha.hamming_topk(q_sig, k_sig, selection_heads=selection_heads, sink_tokens=sink,
                                          local_tokens=local, budget_tokens=budget, lengths=lengths,
                                          start_positions=starts, budgets=budgets)
        out, lse = ha.sparse_attention(query, key_cache, value_cache, indices, counts, scale=head_dim**-0.5)
        return indices, counts, out, lse

    fill()
    graph, static_outputs = capture_cuda_graph(step)
    for replay in range(3):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        expected = step()
        assert_equal_outputs(static_outputs, expected, f"replay {replay}")
        # and the selection is the CPU kernel's
        cpu = ha.hamming_topk(q_sig.cpu(), k_sig.cpu(), selection_heads=selection_heads, sink_tokens=sink,
                              local_tokens=local, budget_tokens=budget, lengths=lengths.cpu(),
                              start_positions=starts.cpu(), budgets=budgets.cpu())
        assert torch.equal(static_outputs[0].cpu(), cpu[0]) and torch.equal(static_outputs[1].cpu(), cpu[1])


def test_paged_attention_graph_replays_with_new_block_table():
    batch, query_heads, kv_heads, head_dim, page_size, pages, width = 2, 8, 2, 64, 16, 64, 200
    dtype = torch.float16
    g = generator_for("graph-paged")
    dev = "cuda"
    query = torch.empty(batch, query_heads, 1, head_dim, dtype=dtype, device=dev)
    key_cache = torch.empty(pages, page_size, kv_heads, head_dim, dtype=dtype, device=dev)
    value_cache = torch.empty_like(key_cache)
    block_table = torch.empty(batch, pages // batch, dtype=torch.int32, device=dev)
    indices = torch.empty(batch, kv_heads, 1, width, dtype=torch.int32, device=dev)
    counts = torch.empty(batch, kv_heads, 1, dtype=torch.int32, device=dev)
    keys = (pages // batch) * page_size

    def fill():
        query.copy_(torch.randn(query.shape, generator=g).to(dtype))
        key_cache.copy_(torch.randn(key_cache.shape, generator=g).to(dtype))
        value_cache.copy_(torch.randn(value_cache.shape, generator=g).to(dtype))
        block_table.copy_(torch.randperm(pages, generator=g)[: block_table.numel()].view(block_table.shape))
        indices.copy_(torch.randint(0, keys, indices.shape, generator=g, dtype=torch.int32))
        counts.copy_(torch.randint(0, width + 1, counts.shape, generator=g, dtype=torch.int32))

    def step():
        return ha.sparse_attention(query, key_cache, value_cache, indices, counts, scale=0.125,
                                   block_table=block_table)

    assert_replays_match_eager(fill, step, "paged replay")


def test_encode_pack_and_scores_graph_replays():
    g = generator_for("graph-encode")
    dev = "cuda"
    x = torch.empty(1, 4, 3, 64, device=dev)
    weights = [torch.randn(4, 64, 64, generator=g).to(dev) * 0.1, torch.randn(4, 64, 64, generator=g).to(dev) * 0.1]
    biases = [torch.randn(4, 64, generator=g).to(dev) * 0.1, torch.randn(4, 64, generator=g).to(dev) * 0.1]
    scores_in = torch.empty(2, 4, 3, 512, device=dev)
    keys = torch.empty(1, 4, 900, 2, dtype=torch.int32, device=dev)

    def fill():
        x.copy_(torch.randn(x.shape, generator=g))
        scores_in.copy_(torch.randn(scores_in.shape, generator=g))
        keys.copy_(random_signatures(keys.shape, g))

    def step():
        signatures = ha.encode_signatures(x, weights, biases)
        packed = ha.pack_signs(scores_in)
        scores = ha.hamming_scores(signatures.expand(1, 4, 3, 2).contiguous(), keys, selection_heads=2)
        selected = ha.topk_from_scores(scores_in, sink_tokens=4, local_tokens=8, budget_tokens=50)
        return (signatures, packed, scores, *selected)

    assert_replays_match_eager(fill, step, "encode replay")


@pytest.mark.parametrize("key_rows", [1, 70])  # one fused launch; the key on cuBLAS, the query fused
def test_encode_pair_graph_replays(key_rows):
    g = generator_for("graph-encode-pair", key_rows)
    dev = "cuda"
    query = torch.empty(2, 8, 1, 64, dtype=torch.bfloat16, device=dev)
    key = torch.empty(1, 2, key_rows, 64, dtype=torch.bfloat16, device=dev)
    qw = [(torch.randn(8, 64, 64, generator=g) * 0.1).to(dev, torch.bfloat16),
          (torch.randn(8, 64, 32, generator=g) * 0.1).to(dev, torch.bfloat16)]
    qb = [(torch.randn(8, 64, generator=g) * 0.1).to(dev, torch.bfloat16),
          (torch.randn(8, 32, generator=g) * 0.1).to(dev, torch.bfloat16)]
    kw = [w.flip(0).contiguous() for w in qw]
    kb = [b.flip(0).contiguous() for b in qb]

    def fill():
        query.copy_(torch.randn(query.shape, generator=g).to(torch.bfloat16))
        key.copy_(torch.randn(key.shape, generator=g).to(torch.bfloat16))

    def step():
        return ha.encode_signatures_pair(query, qw, qb, key, kw, kb)

    assert_replays_match_eager(fill, step, "encode pair replay")
