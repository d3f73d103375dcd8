"""hamming_topk and topk_from_scores: exact selection (same set, same order, ties included)."""

import pytest
import torch

import hashattention as ha
from hashattention import reference
from op_helpers import generator_for, random_lengths, random_signatures

HEAD_LAYOUTS = [(4, 4), (8, 2), (9, 3)]
WINDOWS = [(0, 0), (4, 3), (16, 16)]


def budget_cases(keys):
    """Heavy budgets below, at and above the number of keys."""
    return sorted({max(1, keys // 4), keys, keys + 5})


def assert_same_selection(got, expected, what):
    got_indices, got_counts = (t.cpu() for t in got)
    exp_indices, exp_counts = expected
    assert got_indices.dtype == torch.int32 and got_counts.dtype == torch.int32
    assert got_indices.shape == exp_indices.shape, what
    assert torch.equal(got_counts, exp_counts), f"{what}: counts differ"
    if not torch.equal(got_indices, exp_indices):
        bad = (got_indices != exp_indices).nonzero()[0].tolist()
        row = tuple(bad[:3])
        raise AssertionError(
            f"{what}: indices differ at row {row}:\n got      {got_indices[row].tolist()}\n expected {exp_indices[row].tolist()}"
        )


@pytest.mark.parametrize("query_heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("group_shared", [False, True])
@pytest.mark.parametrize("keys", [0, 1, 57, 2500])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("words", [1, 2])
@pytest.mark.parametrize("ragged", [False, True])
def test_hamming_topk_matches_reference(device, query_heads, kv_heads, group_shared, keys, rows, words, ragged):
    batch = 3 if ragged else 1
    selection_heads = kv_heads if group_shared else query_heads
    for key_heads in sorted({query_heads, kv_heads}):
        for sink, local in WINDOWS:
            for budget in budget_cases(keys):
                if sink + local + budget == 0:
                    continue  # rejected by design (tested in test_bad_inputs)
                case = ("topk", device, query_heads, kv_heads, group_shared, keys, rows, words, ragged, key_heads,
                        sink, local, budget)
                g = generator_for(*case)
                q = random_signatures((batch, query_heads, rows, words), g, device)
                k = random_signatures((batch, key_heads, keys, words), g, device)
                lengths, starts = random_lengths(batch, keys, g, ragged)
                kwargs = dict(selection_heads=selection_heads, sink_tokens=sink, local_tokens=local,
                              budget_tokens=budget)
                if ragged:
                    kwargs.update(lengths=lengths.to(device), start_positions=starts.to(device))
                got = ha.hamming_topk(q, k, **kwargs)
                kwargs.update(lengths=lengths, start_positions=starts)
                expected = reference.hamming_topk(q.cpu(), k.cpu(), **kwargs)
                assert_same_selection(got, expected, repr(case))


def test_hamming_topk_per_sequence_budgets(device):
    """budgets lowers m per sequence (clamped to [0, budget_tokens]); the output width stays fixed."""
    g = generator_for("budgets", device)
    q = random_signatures((4, 8, 2, 1), g, device)
    k = random_signatures((4, 2, 300, 1), g, device)
    budgets = torch.tensor([0, 10, 64, 1000], dtype=torch.int32)
    kwargs = dict(selection_heads=2, sink_tokens=8, local_tokens=8, budget_tokens=64)
    got = ha.hamming_topk(q, k, budgets=budgets.to(device), **kwargs)
    expected = reference.hamming_topk(q.cpu(), k.cpu(), budgets=budgets, **kwargs)
    assert_same_selection(got, expected, "per-sequence budgets")
    assert got[1].cpu()[:, 0, 1].tolist() == [16, 26, 80, 80]


def test_hamming_topk_ties_go_to_later_positions(device):
    """All keys equal: the heavy picks are the latest candidates before the local window."""
    q = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    k = torch.zeros(1, 1, 100, 1, dtype=torch.int32)
    indices, counts = ha.hamming_topk(q.to(device), k.to(device), selection_heads=1, sink_tokens=2,
                                      local_tokens=3, budget_tokens=4)
    assert counts.item() == 9
    assert indices.cpu().flatten().tolist() == [0, 1, 93, 94, 95, 96, 97, 98, 99]


def test_hamming_topk_full_budget_selects_every_causal_position(device):
    g = generator_for("full", device)
    rows, keys = 5, 40
    q = random_signatures((2, 4, rows, 1), g, device)
    k = random_signatures((2, 4, keys, 1), g, device)
    lengths = torch.tensor([40, 23], dtype=torch.int32)
    starts = torch.tensor([0, 6], dtype=torch.int32)
    indices, counts = ha.hamming_topk(q, k, selection_heads=4, sink_tokens=1, local_tokens=1, budget_tokens=keys,
                                      lengths=lengths.to(device), start_positions=starts.to(device))
    indices, counts = indices.cpu(), counts.cpu()
    for b in range(2):
        for row in range(rows):
            position = int(lengths[b]) - rows + row
            expected = list(range(int(starts[b]), position + 1))
            assert counts[b, 0, row].item() == len(expected)
            assert indices[b, 0, row, : len(expected)].tolist() == expected
            assert (indices[b, 0, row, len(expected):] == -1).all()


def test_padding_rows_select_nothing(device):
    """Rows that sit in the left padding (position < start) get count 0 and only -1."""
    q = torch.zeros(1, 2, 5, 1, dtype=torch.int32)
    k = torch.zeros(1, 2, 10, 1, dtype=torch.int32)
    indices, counts = ha.hamming_topk(q.to(device), k.to(device), selection_heads=2, sink_tokens=2, local_tokens=2,
                                      budget_tokens=2, lengths=torch.tensor([10], dtype=torch.int32).to(device),
                                      start_positions=torch.tensor([7], dtype=torch.int32).to(device))
    # rows sit at positions 5..9; start 7 -> rows 0, 1 see nothing; row 2 sees only position 7
    assert counts.cpu()[0, 0].tolist() == [0, 0, 1, 2, 3]
    assert indices.cpu()[0, 0, 2].tolist() == [7, -1, -1, -1, -1, -1]


SCORE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]


@pytest.mark.parametrize("dtype", SCORE_DTYPES)
@pytest.mark.parametrize("keys", [0, 1, 300, 2100])
@pytest.mark.parametrize("rows", [1, 5])
def test_topk_from_scores_matches_reference(device, dtype, keys, rows):
    for heads, ragged in ((4, False), (3, True)):
        batch = 3 if ragged else 1
        for sink, local in WINDOWS:
            for budget in budget_cases(keys):
                if sink + local + budget == 0:
                    continue
                case = ("scores-topk", device, dtype, keys, rows, heads, ragged, sink, local, budget)
                g = generator_for(*case)
                # few distinct values: many ties
                scores = torch.randint(0, 6, (batch, heads, rows, keys), generator=g).to(dtype)
                if dtype.is_floating_point and keys:
                    scores.view(-1)[:: 11] = float("nan")
                    scores.view(-1)[:: 13] = float("-inf")
                lengths, starts = random_lengths(batch, keys, g, ragged)
                kwargs = dict(sink_tokens=sink, local_tokens=local, budget_tokens=budget)
                if ragged:
                    kwargs.update(lengths=lengths, start_positions=starts)
                expected = reference.topk_from_scores(scores, **kwargs)
                if ragged:
                    kwargs.update(lengths=lengths.to(device), start_positions=starts.to(device))
                got = ha.topk_from_scores(scores.to(device), **kwargs)
                assert_same_selection(got, expected, repr(case))


def test_topk_from_scores_strided(device):
    g = generator_for("scores-strided", device)
    scores = torch.randn(2, 50, 3, 4, generator=g).permute(0, 2, 3, 1)  # (B, Hs, L, N) view, N innermost stride 12
    kwargs = dict(sink_tokens=2, local_tokens=2, budget_tokens=7)
    got = ha.topk_from_scores(scores.to(device), **kwargs)
    assert_same_selection(got, reference.topk_from_scores(scores, **kwargs), "strided scores")


def test_topk_from_scores_exact_oracle_order(device):
    scores = torch.tensor([[[[5.0, 1.0, 9.0, 9.0, float("nan"), 7.0, 0.0, 2.0]]]])
    indices, counts = ha.topk_from_scores(scores.to(device), sink_tokens=0, local_tokens=1, budget_tokens=3)
    # local: position 7; heavy among 0..6: 9 (pos 3), 9 (pos 2), 7 (pos 5) -> sorted
    assert counts.item() == 4
    assert indices.cpu().flatten().tolist() == [2, 3, 5, 7]
