"""The chunked fast path of the CUDA hamming_topk against the CPU kernel, in the shapes it splits.

The unit grid (test_selection.py) stays below ~2.5K keys, so a CUDA row there spans at most a
few chunks. Here rows are long and few (batch 1: many chunks per row), start offsets and
lengths are odd (the first and last 4-position groups of a row are partial, so the 16-byte
loads fall back to scalar ones there), signatures come from a tiny pool (scores collapse onto
a few values, so ties at the threshold span many chunks and the earliest ones must be
dropped), key signatures are strided views (no vector loads), and the score range covers each
histogram variant: per thread (33 values), per warp (group sums, two words) and per block.
The CPU kernel is the reference (it is itself checked against hashattention.reference).
HASHATTENTION_SELECTION=chunked keeps every case on this path (most of them would otherwise fit
the one-launch resident path, tested in test_cuda_selection_resident.py). Skipped without a GPU.
"""

import pytest
import torch

import hashattention as ha
from op_helpers import generator_for

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ha.WITH_CUDA), reason="needs a GPU and the CUDA kernels"
)


@pytest.fixture(autouse=True)
def chunked_path(monkeypatch):
    monkeypatch.setenv("HASHATTENTION_SELECTION", "chunked")


def signatures(shape, g, pool: int):
    """int32 signatures; pool > 0 draws them from that many distinct values (many ties)."""
    if pool:
        values = torch.randint(-2**31, 2**31 - 1, (pool,), generator=g, dtype=torch.int64).to(torch.int32)
        return values[torch.randint(0, pool, shape, generator=g)]
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def check(q_sig, k_sig, selection_heads, budget, lengths=None, starts=None, budgets=None, sink=128, local=128):
    kwargs = dict(selection_heads=selection_heads, sink_tokens=sink, local_tokens=local, budget_tokens=budget)
    expected = ha.hamming_topk(q_sig, k_sig, lengths=lengths, start_positions=starts, budgets=budgets, **kwargs)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    got = ha.hamming_topk(cuda(q_sig), cuda(k_sig), lengths=cuda(lengths), start_positions=cuda(starts),
                          budgets=cuda(budgets), **kwargs)
    assert torch.equal(got[1].cpu(), expected[1]), "counts differ from the CPU kernel"
    differ = (got[0].cpu() != expected[0]).nonzero()
    assert differ.numel() == 0, f"{differ.shape[0]} index entries differ, first at {differ[0].tolist()}"


@pytest.mark.parametrize("keys", [4097, 40_003, 131_075])
@pytest.mark.parametrize("pool", [0, 3])
@pytest.mark.parametrize("sparsity", [8, 32])
def test_per_query_head_long_rows(keys, pool, sparsity):
    """The benchmark's layout: 32 query heads over 8 KV heads, one word, batch 1."""
    g = generator_for("chunks-per-head", keys, pool, sparsity)
    q_sig = signatures((1, 32, 1, 1), g, pool)
    k_sig = signatures((1, 8, keys, 1), g, pool)
    check(q_sig, k_sig, 32, max(keys // sparsity - 256, 1))


@pytest.mark.parametrize("pool", [0, 2])
def test_ragged_batch_with_odd_starts_and_budgets(pool):
    g = generator_for("chunks-ragged", pool)
    keys = 30_001
    q_sig = signatures((3, 8, 2, 1), g, pool)
    k_sig = signatures((3, 8, keys, 1), g, pool)
    lengths = torch.tensor([keys, 17_777, 301], dtype=torch.int32)
    starts = torch.tensor([0, 1_235, 7], dtype=torch.int32)
    budgets = torch.tensor([2_000, 333, 5_000], dtype=torch.int32)
    check(q_sig, k_sig, 8, 4_096, lengths, starts, budgets, sink=5, local=9)


@pytest.mark.parametrize("words,group_shared,pool", [(1, True, 0), (1, True, 4), (2, False, 0), (2, True, 0),
                                                       (8, True, 0)])
def test_wider_score_ranges(words, group_shared, pool):
    """Group sums and several words: per-warp (129, 65, 257 values) and per-block (1025) histograms."""
    g = generator_for("chunks-wide", words, group_shared, pool)
    keys = 50_000
    q_sig = signatures((1, 32, 1, words), g, pool)
    k_sig = signatures((1, 8, keys, words), g, pool)
    check(q_sig, k_sig, 8 if group_shared else 32, 1_500)


def test_strided_key_signatures_and_misaligned_rows():
    """A (B, H, N, 1) view with a row stride of 3 words and an odd storage offset: scalar loads only."""
    g = generator_for("chunks-strided")
    keys = 20_011
    storage = signatures((1, 8, keys, 3), g, 0)
    k_sig = storage[..., 1:2]
    q_sig = signatures((1, 32, 1, 1), g, 0)
    check(q_sig, k_sig, 32, 700)
    offset = signatures((8 * keys + 1,), g, 0)[1:].view(1, 8, keys, 1)  # 4-byte but not 16-byte aligned
    check(q_sig, offset, 32, 700)


def test_every_candidate_tied():
    """All signatures equal: the heavy picks are the latest candidates, across all chunks."""
    keys = 100_003
    q_sig = torch.zeros(1, 4, 1, 1, dtype=torch.int32)
    k_sig = torch.zeros(1, 4, keys, 1, dtype=torch.int32)
    check(q_sig, k_sig, 4, 12_345, sink=3, local=2)
