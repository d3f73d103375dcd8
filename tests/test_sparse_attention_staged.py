"""The staged main loop of the CUDA sparse attention (HASHATTENTION_ATTENTION_STAGES = 1..4: K/V
rows copied ahead into shared memory by cp.async) against the float64 reference and against the
plain loop, which consumes the same rows in the same order and so must give the same bits.

The staged loop serves one query head per block with float16 / bfloat16 K/V whose rows start on
16-byte boundaries; elsewhere the variable is ignored and the other loops run, which is checked too."""

import pytest
import torch

import hashattention as ha
from hashattention import reference
from conftest import capture_cuda_graph, generator_for
from test_sparse_attention import check_attention, random_index_lists

STAGES = "HASHATTENTION_ATTENTION_STAGES"

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ha.WITH_CUDA),
                                reason="needs a CUDA build and a GPU")


def attend(monkeypatch, stages, *args, **kwargs):
    """sparse_attention on the GPU with the given stage count (None: the variable unset)."""
    if stages is None:
        monkeypatch.delenv(STAGES, raising=False)
    else:
        monkeypatch.setenv(STAGES, str(stages))
    out, lse = ha.sparse_attention(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def hf_case(g, dtype, batch, query_heads, kv_heads, rows, keys, head_dim, width):
    q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    indices, counts = random_index_lists(batch, query_heads, rows, width, keys, g)
    return q, k, v, indices, counts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("keys,rows,width", [(1, 1, 1), (300, 3, 37), (5000, 2, 1531)])
def test_staged_loop_matches_reference_and_plain_loop(monkeypatch, dtype, head_dim, stages, keys, rows, width):
    """Every stage count: partial steps and tiles (width 37, counts drawn at random), empty lists,
    and lists long enough for several tiles per warp, so the copies run ahead across tiles."""
    case = ("staged-hf", dtype, head_dim, stages, keys, rows, width)
    g = generator_for(*case)
    q, k, v, indices, counts = hf_case(g, dtype, 2, 8, 2, rows, keys, head_dim, width)
    counts[-1, -1, -1] = 0  # an empty list
    scale = head_dim**-0.5
    staged = attend(monkeypatch, stages, q, k, v, indices, counts, scale=scale)
    check_attention(staged, reference.sparse_attention(q, k, v, indices, counts, scale=scale), dtype, repr(case))
    plain = attend(monkeypatch, 0, q, k, v, indices, counts, scale=scale)
    assert torch.equal(staged[0], plain[0]) and torch.equal(staged[1], plain[1]), f"{case}: staged != plain loop"


@pytest.mark.parametrize("stages", [1, 3, 4])
@pytest.mark.parametrize("blocks_per_sm,min_rows", [("1", "1"), ("16", "1"), ("4", "100000")])
@pytest.mark.parametrize("cluster", [None, "0"])
def test_staged_loop_under_every_launch_shape(monkeypatch, stages, blocks_per_sm, min_rows, cluster):
    """Few long splits (a warp walks many tiles), many splits of a few rows (most warps have no
    step, so their copies are only empty groups), merged in a cluster or through the counters."""
    monkeypatch.setenv("HASHATTENTION_ATTENTION_BLOCKS_PER_SM", blocks_per_sm)
    monkeypatch.setenv("HASHATTENTION_ATTENTION_MIN_ROWS", min_rows)
    if cluster is not None:
        monkeypatch.setenv("HASHATTENTION_ATTENTION_CLUSTER", cluster)
    case = ("staged-launch", stages, blocks_per_sm, min_rows, cluster)
    g = generator_for(*case)
    q, k, v, indices, counts = hf_case(g, torch.bfloat16, 2, 8, 2, 2, 6000, 128, 2100)
    scale = 128**-0.5
    staged = attend(monkeypatch, stages, q, k, v, indices, counts, scale=scale)
    check_attention(staged, reference.sparse_attention(q, k, v, indices, counts, scale=scale), torch.bfloat16,
                    repr(case))
    plain = attend(monkeypatch, 0, q, k, v, indices, counts, scale=scale)
    assert torch.equal(staged[0], plain[0]) and torch.equal(staged[1], plain[1]), f"{case}: staged != plain loop"


def drop_entries(indices, counts, skipped):
    """The lists with the entries where `skipped` is true taken out (later entries move up)."""
    kept_indices = torch.full_like(indices, -1)
    kept_counts = torch.zeros_like(counts)
    for row in range(indices[..., 0].numel()):
        b, s, l = torch.unravel_index(torch.tensor(row), counts.shape)
        n = int(counts[b, s, l])
        keep = indices[b, s, l, :n][~skipped[b, s, l, :n]]
        kept_indices[b, s, l, : keep.numel()] = keep
        kept_counts[b, s, l] = keep.numel()
    return kept_indices, kept_counts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_staged_loop_paged_layout_and_entries_it_must_skip(monkeypatch, dtype, page_size):
    """Paged K/V through a block table, then the same lists with entries the kernel must skip:
    positions outside [0, keys), and positions whose block-table page is outside the cache. Their
    copies are zero-filled and masked, so the result is the reference over the other entries."""
    case = ("staged-paged", dtype, page_size)
    g = generator_for(*case)
    batch, query_heads, kv_heads, rows, head_dim, keys, width = 2, 8, 2, 2, 128, 900, 400
    max_pages = -(-keys // page_size)
    num_pages = batch * max_pages + 3
    block_table = torch.randperm(num_pages, generator=g)[: batch * max_pages].reshape(batch, max_pages).to(torch.int32)
    k_pages = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(dtype)
    v_pages = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
    indices, counts = random_index_lists(batch, query_heads, rows, width, keys, g)
    scale = head_dim**-0.5

    positions = max_pages * page_size  # what the block table addresses: the kernel's valid range
    bad_indices = indices.clone()
    bad_indices[0, 0, 0, 0] = positions + 5
    bad_indices[1, 3, 1, 2] = -7
    bad_table = block_table.clone()
    bad_table[1, 3] = num_pages + 100  # sequence 1's positions on its page 3 are skipped
    skipped = (bad_indices >= positions) | (bad_indices < 0)
    skipped[1] |= (bad_indices[1] >= 0) & (bad_indices[1] // page_size == 3)
    assert skipped.sum() > 2
    kept_indices, kept_counts = drop_entries(bad_indices, counts, skipped)

    expected = reference.sparse_attention(q, k_pages, v_pages, indices, counts, scale=scale, block_table=block_table)
    expected_kept = reference.sparse_attention(q, k_pages, v_pages, kept_indices, kept_counts, scale=scale,
                                               block_table=block_table)
    for stages in (2, 4):
        got = attend(monkeypatch, stages, q, k_pages, v_pages, indices, counts, scale=scale, block_table=block_table)
        check_attention(got, expected, dtype, f"{case} stages={stages}")
        got = attend(monkeypatch, stages, q, k_pages, v_pages, bad_indices, counts, scale=scale, block_table=bad_table)
        check_attention(got, expected_kept, dtype, f"{case} stages={stages}, entries skipped")
        plain = attend(monkeypatch, 0, q, k_pages, v_pages, bad_indices, counts, scale=scale, block_table=bad_table)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), f"{case}: staged != plain loop"


@pytest.mark.parametrize("what", ["float32", "unaligned rows", "group-shared"])
def test_stages_fall_back_where_the_staged_loop_does_not_apply(monkeypatch, what):
    """float32 K/V, rows off a 16-byte boundary (a cache sliced at an odd offset) and several heads
    per block run the other loops under the variable, and still give the reference."""
    g = generator_for("staged-fallback", what)
    dtype = torch.float32 if what == "float32" else torch.bfloat16
    batch, query_heads, kv_heads, rows, keys, head_dim, width = 2, 8, 2, 1, 700, 64, 200
    q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    if what == "unaligned rows":  # rows of 65 elements: starts 130 bytes apart
        k = torch.randn(batch, kv_heads, keys, head_dim + 1, generator=g).to(dtype)[..., 1:]
        v = torch.randn(batch, kv_heads, keys, head_dim + 1, generator=g).to(dtype)[..., 1:]
    selection_heads = kv_heads if what == "group-shared" else query_heads
    indices, counts = random_index_lists(batch, selection_heads, rows, width, keys, g)
    k_gpu, v_gpu = k.cuda(), v.cuda()
    if what == "unaligned rows":  # keep the odd strides on the GPU
        k_gpu = torch.randn(batch, kv_heads, keys, head_dim + 1, device="cuda").to(dtype)[..., 1:]
        v_gpu = torch.randn(batch, kv_heads, keys, head_dim + 1, device="cuda").to(dtype)[..., 1:]
        k_gpu.copy_(k)
        v_gpu.copy_(v)
    scale = head_dim**-0.5
    monkeypatch.setenv(STAGES, "3")
    got = ha.sparse_attention(q.cuda(), k_gpu, v_gpu, indices.cuda(), counts.cuda(), scale=scale)
    check_attention(tuple(t.cpu() for t in got), reference.sparse_attention(q, k, v, indices, counts, scale=scale),
                    dtype, what)


def test_staged_loop_graph_replays_new_inputs(monkeypatch):
    """Captured with the staged loop (3 stages), replays with new K/V, lists and counts match eager."""
    monkeypatch.setenv(STAGES, "3")
    g = generator_for("staged-graph")
    batch, query_heads, kv_heads, rows, keys, head_dim, width = 1, 8, 2, 1, 4000, 128, 900
    static = [t.cuda() for t in hf_case(g, torch.bfloat16, batch, query_heads, kv_heads, rows, keys, head_dim, width)]
    scale = head_dim**-0.5
    graph, (out, lse) = capture_cuda_graph(lambda: ha.sparse_attention(*static, scale=scale))
    for replay in range(3):
        fresh = hf_case(g, torch.bfloat16, batch, query_heads, kv_heads, rows, keys, head_dim, width)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_attention((out.cpu(), lse.cpu()), reference.sparse_attention(*fresh, scale=scale), torch.bfloat16,
                        f"replay {replay}")


@pytest.mark.parametrize("value", ["5", "-1", "three"])
def test_bad_stage_counts_are_named(monkeypatch, value):
    monkeypatch.setenv(STAGES, value)
    q = torch.randn(1, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.bfloat16)
    indices = torch.arange(200, dtype=torch.int32, device="cuda").expand(1, 4, 1, 200).contiguous()
    with pytest.raises(RuntimeError, match=f"{STAGES} must be an integer in \\[0, 4\\]"):
        ha.sparse_attention(q, k, k, indices, scale=0.125)
