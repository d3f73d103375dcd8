"""torch.ops.hashattention.selection_bounds against per-sequence Python arithmetic
(HashAttentionConfig's budget rule) on random lengths, masks and budget rules, and its bad-input errors."""

import math

import pytest
import torch

import hashattention  # noqa: F401  (registers the ops)
from hashattention import HashAttentionConfig
from op_helpers import generator_for


def expected_bounds(lengths, visible, config):
    """Per sequence: its length, the first True of its mask row (0 for none), the heavy budget."""
    out = []
    for b, length in enumerate(lengths.tolist()):
        row = visible[b].tolist() if visible is not None else []
        start = row.index(True) if True in row else 0
        valid = length - start
        # The requested total (the selection op takes at most the valid keys there are).
        total = config.budget_tokens if config.budget_tokens is not None else math.floor(valid / config.sparsity)
        if valid < config.dense_below_tokens:
            total = valid
        budget = max(total - config.window_tokens, 0)
        out.append((length, start, budget))
    return [torch.tensor(column, dtype=torch.int32) for column in zip(*out)]


RULES = [
    dict(sparsity=8.0), dict(sparsity=32.0, sink_tokens=4, local_tokens=4), dict(sparsity=3.5, local_tokens=0),
    dict(budget_tokens=24), dict(sparsity=16.0, dense_below_tokens=300), dict(budget_tokens=9, dense_below_tokens=50),
]


@pytest.mark.parametrize("rule", range(len(RULES)))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
def test_matches_per_sequence_arithmetic(device, rule, masked, length_dtype):
    config = HashAttentionConfig(**{"sink_tokens": 2, "local_tokens": 6, **RULES[rule]})
    g = generator_for(f"selection_bounds{rule}{masked}", device)
    keys = 600
    lengths = torch.randint(0, keys + 1, (7,), generator=g)
    lengths[0], lengths[1] = 0, keys  # empty and full
    visible = None
    if masked:
        starts = (torch.rand(7, generator=g) * lengths).long()
        visible = (torch.arange(keys) >= starts[:, None]) & (torch.arange(keys) < lengths[:, None])
        visible[2] = False  # a row with nothing visible
    got = torch.ops.hashattention.selection_bounds(
        lengths.to(length_dtype).to(device), None if visible is None else visible.to(device), config.sparsity,
        config.budget_tokens, config.window_tokens, config.dense_below_tokens)
    for name, tensor, want in zip(("lengths", "start_positions", "budgets"), got,
                                  expected_bounds(lengths, visible, config)):
        assert tensor.dtype == torch.int32 and tensor.device.type == torch.device(device).type, name
        assert torch.equal(tensor.cpu(), want), f"{name}: {tensor.cpu().tolist()} != {want.tolist()}"


def test_outputs_do_not_alias_the_lengths():
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    out, _, _ = torch.ops.hashattention.selection_bounds(lengths, None, 2.0, None, 0, 0)
    out.add_(1)
    assert lengths.tolist() == [5, 9]


@pytest.mark.parametrize("args, message", [
    ((torch.ones(2, 3, dtype=torch.int32), None, 2.0, None, 0, 0), "lengths must be a 1-D int32 or int64"),
    ((torch.ones(2), None, 2.0, None, 0, 0), "lengths must be a 1-D int32 or int64"),
    ((torch.ones(2, dtype=torch.int32), torch.ones(3, 5, dtype=torch.bool), 2.0, None, 0, 0), "B = 2"),
    ((torch.ones(2, dtype=torch.int32), torch.ones(2, 5), 2.0, None, 0, 0), "visible must be a 2-D bool"),
    ((torch.ones(2, dtype=torch.int32), None, None, None, 0, 0), "exactly one of sparsity and budget_tokens"),
    ((torch.ones(2, dtype=torch.int32), None, 2.0, 8, 0, 0), "exactly one of sparsity and budget_tokens"),
    ((torch.ones(2, dtype=torch.int32), None, 0.5, None, 0, 0), "sparsity must be >= 1"),
    ((torch.ones(2, dtype=torch.int32), None, None, -1, 0, 0), "budget_tokens must be >= 0"),
    ((torch.ones(2, dtype=torch.int32), None, 2.0, None, -3, 0), "window_tokens and dense_below_tokens"),
])
def test_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.hashattention.selection_bounds(*args)
