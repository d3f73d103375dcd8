"""CUDA kernels on very long rows and on the paths the small grid does not reach.

* N >= 1M keys on a small head count: the chunked fast path of hamming_topk (many chunks per
  row) and split-K sparse_attention over tens of thousands of selected rows, against the CPU
  kernels (the ground truth; the float64 reference would be too slow here).
* Wide score ranges (many words x a large group) that take the radix-select path.
* The device-side handling of values the CPU kernels reject (documented in the README).
Skipped without a GPU.
"""

import pytest
import torch

import hashattention as ha
from op_helpers import ATTENTION_TOLERANCE, assert_close_verbose, generator_for, random_signatures

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ha.WITH_CUDA), reason="needs a GPU and the CUDA kernels"
)


def topk_both(q_sig, k_sig, **kwargs):
    cuda = ha.hamming_topk(q_sig.cuda(), k_sig.cuda(), **{k: (v.cuda() if torch.is_tensor(v) else v)
                                                          for k, v in kwargs.items()})
    cpu = ha.hamming_topk(q_sig, k_sig, **kwargs)
    return [t.cpu() for t in cuda], cpu


def assert_same_selection(got, expected, what):
    indices, counts = got
    ref_indices, ref_counts = expected
    assert torch.equal(counts, ref_counts), f"{what}: counts differ"
    differ = (indices != ref_indices).nonzero()
    assert differ.numel() == 0, f"{what}: {differ.shape[0]} index entries differ, first at {differ[0].tolist()}"


@pytest.mark.parametrize("group_shared", [False, True])
def test_hamming_topk_million_keys_matches_cpu(group_shared):
    keys = (1 << 20) + 4321
    batch, query_heads, kv_heads, rows = 1, 4, 2, 2
    selection_heads = kv_heads if group_shared else query_heads
    key_heads = kv_heads if group_shared else query_heads
    g = generator_for("long-topk", group_shared)
    q_sig = random_signatures((batch, query_heads, rows, 1), g)
    # Few distinct key signatures: scores collide a lot, so ties at the threshold are many.
    palette = random_signatures((64,), g)
    k_sig = palette[torch.randint(0, 64, (batch, key_heads, keys, 1), generator=g)]
    got, expected = topk_both(q_sig, k_sig, selection_heads=selection_heads, sink_tokens=128, local_tokens=128,
                              budget_tokens=keys // 32)
    assert_same_selection(got, expected, "1M keys")


def test_hamming_topk_long_ragged_batch_matches_cpu():
    keys, batch = 300_000, 3
    g = generator_for("long-ragged")
    q_sig = random_signatures((batch, 8, 1, 2), g)
    k_sig = random_signatures((batch, 2, keys, 2), g)
    lengths = torch.tensor([keys, 1000, 250_000], dtype=torch.int32)
    starts = torch.tensor([0, 999, 4096], dtype=torch.int32)
    budgets = torch.tensor([9000, 9000, 17], dtype=torch.int32)
    got, expected = topk_both(q_sig, k_sig, selection_heads=2, sink_tokens=64, local_tokens=64, budget_tokens=9000,
                              lengths=lengths, start_positions=starts, budgets=budgets)
    assert_same_selection(got, expected, "ragged long")


@pytest.mark.parametrize("words,query_heads,selection_heads", [(32, 8, 2), (16, 16, 1)])
def test_hamming_topk_wide_score_range_radix_path(words, query_heads, selection_heads):
    g = generator_for("wide", words, query_heads, selection_heads)
    q_sig = random_signatures((2, query_heads, 3, words), g)
    k_sig = random_signatures((2, query_heads, 5000, words), g)
    got, expected = topk_both(q_sig, k_sig, selection_heads=selection_heads, sink_tokens=7, local_tokens=9,
                              budget_tokens=700)
    assert_same_selection(got, expected, f"W={words}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64, torch.uint8])
def test_topk_from_scores_long_rows_with_ties_and_nan(dtype):
    g = generator_for("scores-long", dtype)
    keys = 200_000
    scores = torch.randint(0, 50, (1, 2, 2, keys), generator=g).to(dtype)
    if dtype.is_floating_point:
        scores[0, 0, 0, ::97] = float("nan")
        scores[0, 1, 1, ::13] = float("-inf")
        scores[0, 1, 0, ::7] = -0.0
    kwargs = dict(sink_tokens=5, local_tokens=11, budget_tokens=6000)
    got = [t.cpu() for t in ha.topk_from_scores(scores.cuda(), **kwargs)]
    assert_same_selection(got, ha.topk_from_scores(scores, **kwargs), f"scores {dtype}")


@pytest.mark.parametrize("group_shared", [False, True])
def test_sparse_attention_long_lists_match_cpu(group_shared):
    batch, query_heads, kv_heads, keys, head_dim, width = 1, 4, 2, (1 << 20) + 17, 128, 40_000
    selection_heads = kv_heads if group_shared else query_heads
    dtype = torch.bfloat16
    g = generator_for("long-attention", group_shared)
    q = torch.randn(batch, query_heads, 1, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    indices = torch.stack([torch.randperm(keys, generator=g)[:width].sort().values for _ in range(selection_heads)])
    indices = indices.view(batch, selection_heads, 1, width).to(torch.int32)
    counts = torch.randint(width // 2, width + 1, (batch, selection_heads, 1), generator=g, dtype=torch.int32)
    out, lse = ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), indices.cuda(), counts.cuda(), scale=head_dim**-0.5)
    ref_out, ref_lse = ha.sparse_attention(q.float(), k.float(), v.float(), indices, counts, scale=head_dim**-0.5)
    assert_close_verbose(out.cpu(), ref_out, what="long out", **ATTENTION_TOLERANCE[dtype])
    assert_close_verbose(lse.cpu(), ref_lse, what="long lse", atol=1e-3, rtol=1e-4)


def test_device_side_value_semantics():
    """Values the CPU kernels reject are clamped / skipped on the device, as documented."""
    g = generator_for("device-values")
    keys = 500
    q_sig = random_signatures((3, 4, 1, 1), g)
    k_sig = random_signatures((3, 4, keys, 1), g)
    kwargs = dict(selection_heads=4, sink_tokens=4, local_tokens=4, budget_tokens=40)
    lengths = torch.tensor([keys + 100, -5, 300], dtype=torch.int32)  # clamped to [0, N]
    starts = torch.tensor([-3, 0, 400], dtype=torch.int32)  # < 0 -> 0; beyond the length -> empty rows
    budgets = torch.tensor([1000, -1, 10], dtype=torch.int32)  # clamped to [0, budget_tokens]
    got = ha.hamming_topk(q_sig.cuda(), k_sig.cuda(), lengths=lengths.cuda(), start_positions=starts.cuda(),
                          budgets=budgets.cuda(), **kwargs)
    expected = ha.hamming_topk(q_sig, k_sig, lengths=lengths.clamp(0, keys), start_positions=starts.clamp(0, 300)
                               .minimum(lengths.clamp(0, keys)), budgets=budgets.clamp(0, 40), **kwargs)
    expected[0][2] = -1  # start 400 > length 300: nothing selected
    expected[1][2] = 0
    assert_same_selection([t.cpu() for t in got], expected, "clamped values")

    # sparse_attention: out-of-range entries are skipped like padding; counts are clamped.
    q = torch.randn(1, 2, 1, 64, generator=g)
    k = torch.randn(1, 2, 100, 64, generator=g)
    v = torch.randn(1, 2, 100, 64, generator=g)
    indices = torch.tensor([[[[3, 500, 7, -9, 99]], [[1, 2, 100, 4, 5]]]], dtype=torch.int32)
    counts = torch.tensor([[[9], [3]]], dtype=torch.int32)  # 9 > width: all five entries
    out, lse = ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), indices.cuda(), counts.cuda(), scale=0.125)
    clean = torch.tensor([[[[3, 7, 99]], [[1, 2, -1]]]], dtype=torch.int32)
    ref_out, ref_lse = ha.sparse_attention(q, k, v, clean, scale=0.125)
    assert_close_verbose(out.cpu(), ref_out, what="skipped entries", **ATTENTION_TOLERANCE[torch.float32])
    assert_close_verbose(lse.cpu(), ref_lse, what="skipped entries lse", atol=1e-5, rtol=1e-5)
