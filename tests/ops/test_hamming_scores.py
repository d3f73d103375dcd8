"""hamming_scores against the reference (which counts bits by unpacking them)."""

import pytest
import torch

import hashattention as ha
from hashattention import reference
from op_helpers import generator_for, random_signatures

HEAD_LAYOUTS = [(4, 4), (8, 2), (9, 3)]  # (query heads, KV heads)


@pytest.mark.parametrize("query_heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("key_heads_per", ["query", "kv"])
@pytest.mark.parametrize("group_shared", [False, True])
@pytest.mark.parametrize("words", [1, 2])
@pytest.mark.parametrize("keys,rows,batch", [(0, 1, 1), (1, 1, 3), (37, 5, 3), (1000, 1, 1), (2500, 5, 1)])
def test_scores_match_reference(device, query_heads, kv_heads, key_heads_per, group_shared, words, keys, rows, batch):
    g = generator_for("scores", device, query_heads, kv_heads, key_heads_per, group_shared, words, keys, rows, batch)
    key_heads = query_heads if key_heads_per == "query" else kv_heads
    selection_heads = kv_heads if group_shared else query_heads
    q = random_signatures((batch, query_heads, rows, words), g, device)
    k = random_signatures((batch, key_heads, keys, words), g, device)
    scores = ha.hamming_scores(q, k, selection_heads)
    assert scores.shape == (batch, selection_heads, rows, keys) and scores.dtype == torch.int32
    assert torch.equal(scores.cpu(), reference.hamming_scores(q.cpu(), k.cpu(), selection_heads))


def test_scores_extremes(device):
    """Identical signatures score `bits`, complementary ones 0; a group sums its heads."""
    q = torch.tensor([[[[0x0F0F0F0F, -1]]], [[[7, 0]]]], dtype=torch.int32)  # (2, 1, 1, 2)
    k = torch.cat([q, ~q], dim=2)  # (2, 1, 2, 2): the same, then every bit flipped
    scores = ha.hamming_scores(q.to(device), k.to(device), 1).cpu()
    assert scores[:, 0, 0].tolist() == [[64, 0], [64, 0]]
    q2 = q.repeat(1, 4, 1, 1)  # 4 query heads sharing one key head and one selection
    assert ha.hamming_scores(q2.to(device), k.to(device), 1).cpu()[:, 0, 0].tolist() == [[256, 0], [256, 0]]


def test_scores_strided_inputs(device):
    """A slice of a preallocated signature cache (non-contiguous outer dims) is read in place."""
    g = generator_for("scores-strided", device)
    q = random_signatures((2, 4, 3, 2), g, device)
    cache = random_signatures((2, 4, 50, 2), g, device)
    k = cache[:, :, :31]
    expected = reference.hamming_scores(q.cpu(), k.cpu().contiguous(), 2)
    assert torch.equal(ha.hamming_scores(q, k, 2).cpu(), expected)
