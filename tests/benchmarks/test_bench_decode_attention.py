"""scripts/bench_decode.py's choice of layer buffers and of steps per graph replay (pure arithmetic)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_decode as bd  # noqa: E402

MB = 1 << 20
L2 = 50 * MB


def test_buffers_keep_the_least_reading_step_out_of_l2():
    # B = 1 / 128K: 558 MB per layer, but the group selection reads only 4 MB per step.
    layers = bd.layer_buffers(558 * MB, 4 * MB, L2)
    assert layers == 1 + 25
    # Between two uses of a buffer the other buffers' smallest steps pass through L2 twice.
    assert (layers - 1) * 4 * MB >= bd.L2_PASSES_BETWEEN_USES * L2


def test_buffers_hold_eight_l2s_when_the_layers_are_small():
    layers = bd.layer_buffers(10 * MB, 60 * MB, L2)  # a step that reads more than its layer's share
    assert layers == 40 and layers * 10 * MB >= bd.L2_MULTIPLE_IN_ALL * L2


def test_buffers_are_at_least_two_and_capped():
    assert bd.layer_buffers(10_000 * MB, 10_000 * MB, L2) == 2
    assert bd.layer_buffers(1 * MB, 1024, L2) == bd.MAX_LAYER_BUFFERS


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_buffers_reject_non_positive_sizes(args):
    with pytest.raises(ValueError, match="positive"):
        bd.layer_buffers(*args)


def test_replays_run_at_least_a_models_layers():
    assert bd.replay_cycles(2, 40.0) == 16  # 32 steps
    assert bd.replay_cycles(3, 20.0) == 11  # 33 steps
    assert bd.replay_cycles(26, 10.0) == 2
    assert bd.replay_cycles(401, 5.0) == 1
    for layers in (1, 2, 5, 7, 31, 32):
        assert layers * bd.replay_cycles(layers, 1.0) >= bd.MIN_STEPS_PER_REPLAY


def test_long_passes_are_not_repeated():
    assert bd.replay_cycles(2, bd.LONG_REPLAY_US / 2) == 1
    assert bd.replay_cycles(2, bd.LONG_REPLAY_US / 2 - 1) == 16
    with pytest.raises(ValueError, match="layers"):
        bd.replay_cycles(0, 1.0)


def test_speedups_against_the_best_dense_row_except_for_the_empty_launch():
    rows = [dict(batch=1, n=8, row="sdpa-cudnn", us=20.0), dict(batch=1, n=8, row="sdpa-flash", us=30.0),
            dict(batch=1, n=8, row="ours-per-head", us=10.0), dict(batch=1, n=8, row="floor-empty", us=2.0),
            dict(batch=8, n=8, row="ours-group", us=5.0)]  # no dense row for B = 8
    bd.add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 20.0 / 30.0, 2.0, None, None]


def test_probe_buffers_follow_the_benchmark_rule_within_memory():
    # probe_selection at B = 1 / 32K per head: 4 MB of signatures per layer, all of it read.
    assert bd.probe_buffers(None, 4 * MB, 4 * MB, L2, 1 << 40) == bd.layer_buffers(4 * MB, 4 * MB, L2)
    # probe_attention at 128K: 536 MB of K/V per layer, 8 MB read; 4 GiB allows 7 layers, not the 14 of the rule.
    assert bd.probe_buffers(None, 536 * MB, 8 * MB, L2, 4 << 30) == 7
    assert bd.probe_buffers(None, 536 * MB, 8 * MB, L2, 100 * MB) == 2  # never fewer than two
    assert bd.probe_buffers(5, 536 * MB, 8 * MB, L2, 100 * MB) == 5  # an explicit --layers wins
    with pytest.raises(ValueError, match="layers"):
        bd.probe_buffers(0, 536 * MB, 8 * MB, L2, 1 << 40)
