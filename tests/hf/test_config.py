"""HashAttentionConfig: every field validated on construction (ValueError naming the field), and the budget rule."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from hashattention.config import MAX_TOKENS, HashAttentionConfig

INT_FIELDS = ("sink_tokens", "local_tokens", "budget_tokens", "sparse_prompt_tokens", "dense_below_tokens", "bits")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget_tokens=100, sparsity=8.0), "not both"),
        (dict(budget_tokens=10), "sink_tokens \\+ local_tokens"),
        (dict(sparsity=1.0), "sparsity"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(selection="per_token"), "selection"),
        (dict(selection=["query_head"]), "selection"),
        (dict(dense_layers=[-1]), "dense_layers"),
        (dict(dense_layers=3), "dense_layers"),
        (dict(dense_layers="01"), "dense_layers"),
        (dict(bits=48), "bits"),
        (dict(sparse_prompt_tokens=1.5), "sparse_prompt_tokens"),
        # a row must attend to at least one token
        (dict(sink_tokens=0, local_tokens=0, sparsity=16), "sink_tokens \\+ local_tokens must be >= 1 with sparsity"),
        (dict(sink_tokens=0, local_tokens=0), "sink_tokens \\+ local_tokens must be >= 1 with sparsity"),
        (dict(sink_tokens=0, local_tokens=0, budget_tokens=0), "budget_tokens"),
        # the ops' int32 index arithmetic
        (dict(budget_tokens=2**40), "budget_tokens must be an int in \\[1, 2147483647\\]"),
        (dict(budget_tokens=2**70), "budget_tokens must be an int in"),
        (dict(sink_tokens=2**31), "sink_tokens must be an int in"),
        (dict(local_tokens=2**31, sink_tokens=0), "local_tokens must be an int in"),
        (dict(sink_tokens=2**30, local_tokens=2**30), "sink_tokens \\+ local_tokens must be <= 2147483647"),
        (dict(sparse_prompt_tokens=2**31), "sparse_prompt_tokens"),
        (dict(dense_below_tokens=2**63), "dense_below_tokens"),
        (dict(dense_layers=[2**31]), "dense_layers"),
        (dict(bits=2**36), "bits"),
        # non-finite or non-numeric sparsity
        (dict(sparsity=math.nan), "sparsity must be a finite number"),
        (dict(sparsity=math.inf), "sparsity must be a finite number"),
        (dict(sparsity=-math.inf), "sparsity"),
        (dict(sparsity=np.float64("nan")), "sparsity"),
        (dict(sparsity=True), "sparsity must be a number"),
        (dict(sparsity="16"), "sparsity must be a number"),
        (dict(dense_layers=[True]), "dense_layers entries must be an int"),
        (dict(dense_layers=[1.0]), "dense_layers entries must be an int"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HashAttentionConfig(**kwargs)


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [True, 64.0, np.float32(64), "64", -1])
def test_int_fields_take_ints_only(field, value):
    """bool (an int subclass), floats, strings and negatives are refused by every int field, by name."""
    kwargs = {field: value}
    if field == "budget_tokens":
        kwargs.update(sink_tokens=0, local_tokens=1)
    with pytest.raises(ValueError, match=f"HashAttentionConfig.{field} must be an int"):
        HashAttentionConfig(**kwargs)


def test_numpy_ints_are_accepted_as_plain_ints():
    config = HashAttentionConfig(sink_tokens=np.int64(4), local_tokens=np.int32(4), budget_tokens=np.int64(64),
                                 dense_layers=np.array([3, 1]), bits=np.int16(32))
    assert (config.sink_tokens, config.local_tokens, config.budget_tokens, config.dense_layers, config.bits) == (
        4, 4, 64, (1, 3), 32)
    assert all(type(v) is int for v in (config.sink_tokens, config.budget_tokens, config.bits, *config.dense_layers))
    assert type(HashAttentionConfig(sparsity=np.float32(8)).sparsity) is float


def test_largest_accepted_values_fit_int32():
    config = HashAttentionConfig(sink_tokens=1, local_tokens=1, budget_tokens=MAX_TOKENS)
    assert config.heavy_tokens(10) == MAX_TOKENS - 2 and config.heavy_width(1 << 20) == 1 << 20
    assert MAX_TOKENS == 2**31 - 1


def test_every_accepted_config_attends_to_at_least_one_token():
    """Over windows, budgets and short sequences: a config either raises or gives each row >= 1 token."""
    accepted = 0
    for sink, local, budget in itertools.product((0, 1, 3), (0, 1, 2), (None, 1, 2, 8, 16.0, 3.5)):
        kwargs = dict(sink_tokens=sink, local_tokens=local)
        kwargs["budget_tokens" if isinstance(budget, int) else "sparsity"] = budget
        try:
            config = HashAttentionConfig(**kwargs)
        except ValueError:
            continue
        accepted += 1
        for n in range(1, 40):
            assert config.total_tokens(n) >= 1, (config, n)
    assert accepted > 30


def test_config_budget_arithmetic():
    config = HashAttentionConfig()
    assert config.sparsity == 16.0 and config.budget_tokens is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sparsity = 2.0
    assert config.total_tokens(4096) == 256 and config.total_tokens(32768) == 2048 and config.total_tokens(100) == 100
    assert config.heavy_width(32768) == 2048 - 256
    assert HashAttentionConfig(budget_tokens=512).total_tokens(10_000) == 512
    with pytest.raises(ValueError, match="budget_tokens"):
        dataclasses.replace(config, sparsity=None, budget_tokens=2**40)  # replace validates again
