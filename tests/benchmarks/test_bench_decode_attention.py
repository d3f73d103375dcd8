"""benchmarks.decode_attention and the graph-timing arithmetic of benchmarks.common (no GPU needed):
the layer buffers and steps per replay, the speedups, and the results files rendered from rows."""

import json

import pytest

from benchmarks import common
from benchmarks import decode_attention as bd

MB = 1 << 20
L2 = 50 * MB


def test_buffers_keep_the_least_reading_step_out_of_l2():
    # B = 1 / 128K: 558 MB per layer, but the group selection reads only 4 MB per step.
    layers = common.layer_buffers(558 * MB, 4 * MB, L2)
    assert layers == 1 + 25
    # Between two uses of a buffer the other buffers' smallest steps pass through L2 twice.
    assert (layers - 1) * 4 * MB >= common.L2_PASSES_BETWEEN_USES * L2


def test_buffers_hold_eight_l2s_when_the_layers_are_small():
    layers = common.layer_buffers(10 * MB, 60 * MB, L2)  # a step that reads more than its layer's share
    assert layers == 40 and layers * 10 * MB >= common.L2_MULTIPLE_IN_ALL * L2


def test_buffers_are_at_least_two_and_capped():
    assert common.layer_buffers(10_000 * MB, 10_000 * MB, L2) == 2
    assert common.layer_buffers(1 * MB, 1024, L2) == common.MAX_LAYER_BUFFERS


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_buffers_reject_non_positive_sizes(args):
    with pytest.raises(ValueError, match="positive"):
        common.layer_buffers(*args)


def test_replays_run_at_least_a_models_layers():
    assert common.replay_cycles(2, 40.0) == 16  # 32 steps
    assert common.replay_cycles(3, 20.0) == 11  # 33 steps
    assert common.replay_cycles(26, 10.0) == 2
    assert common.replay_cycles(401, 5.0) == 1
    for layers in (1, 2, 5, 7, 31, 32):
        assert layers * common.replay_cycles(layers, 1.0) >= common.MIN_STEPS_PER_REPLAY


def test_long_passes_are_not_repeated():
    assert common.replay_cycles(2, common.LONG_REPLAY_US / 2) == 1
    assert common.replay_cycles(2, common.LONG_REPLAY_US / 2 - 1) == 16
    with pytest.raises(ValueError, match="layers"):
        common.replay_cycles(0, 1.0)


def test_speedups_against_the_best_dense_row_except_for_the_empty_launch():
    rows = [dict(batch=1, n=8, row="sdpa-cudnn", us=20.0), dict(batch=1, n=8, row="sdpa-flash", us=30.0),
            dict(batch=1, n=8, row="ours-per-head", us=10.0), dict(batch=1, n=8, row="floor-empty", us=2.0),
            dict(batch=8, n=8, row="ours-group", us=5.0)]  # no dense row for B = 8
    bd.add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 20.0 / 30.0, 2.0, None, None]


def fake_record():
    """A run's record with made-up times: B = 1 at 32K and 128K (32x, both modes, floors) and B = 8 at 32K."""
    results = []

    def add(batch, n, sparsity, row, us):
        results.append(dict(batch=batch, n=n, sparsity=sparsity, row=row, us=us, bytes=1000, gbps=1.0,
                            floor_pct=10.0))

    for n, dense, scale in ((32768, 37.0, 1.0), (131072, 124.0, 2.0)):
        add(1, n, "-", "sdpa-flash", dense * 1.2)
        add(1, n, "-", "sdpa-cudnn", dense)
        for mode in bd.MODES:
            add(1, n, "32x", f"ours-{mode}", 18.5 * scale)
            add(1, n, "32x", f"select-{mode}", 7.5 * scale)
            add(1, n, "32x", f"attend-{mode}", 11.0 * scale)
            add(1, n, "32x", f"floor-read-{mode}", 6.5 * scale)
            add(1, n, "32x", f"floor-read-select-{mode}", 2.9 * scale)
            add(1, n, "32x", f"floor-read-attend-{mode}", 5.6 * scale)
        add(1, n, "-", "floor-empty", 0.8)
    add(8, 32768, "-", "sdpa-cudnn", 100.0)
    add(8, 32768, "16x", "ours-per-head", 40.0)
    bd.add_speedups(results)
    meta = dict(date="2026-01-01 00:00 UTC", device="NVIDIA H200", torch="2.11.0", cuda="13.0", transformers=None,
                python="3.12.3", code=dict(git_commit="abc1234", git_dirty=False, source_sha256="0" * 16),
                command="python -m benchmarks.decode_attention --batches 1 8", environment={},
                copy_bandwidth_gbps=4200.0,
                replay=dict(min_steps=32, long_replay_us=2000.0, l2_passes_between_uses=2, l2_multiple_in_all=8))
    return dict(meta=meta, results=results, notes=["B=8 n=524288: skipped, needs 200 GiB"])


def test_markdown_states_speedups_read_floors_and_provenance():
    text = bd.markdown(fake_record())
    assert text.startswith("# Decode attention, one Llama-3.1-8B layer (NVIDIA H200)")
    assert "- date: 2026-01-01 00:00 UTC" in text and "- code: commit abc1234, sources " in text
    assert "- command: `python -m benchmarks.decode_attention --batches 1 8`" in text
    # 124 / 37 µs = 3.35x; 37 / 18.5 = 2.00x at 32K
    assert "| 128K | 124.0 | 37.0 | 3.35x | 37.0 | 3.35x | 15.0 | 22.0 |" in text
    assert "| 32K | 37.0 | 18.5 | 2.00x | 18.5 | 2.00x | 7.5 | 11.0 |" in text
    # against the read floor: 37.0 / 13.0 µs = 2.85x
    assert "| 128K | per-head | 37.0 | 13.0 | 2.85x | 15.0 | 5.8 | 22.0 | 11.2 | 0.8 |" in text
    assert "| 8 | 32K | 16x | ours-per-head | 40.0 | 1 | 10.0 | 2.50x |" in text
    assert "- B=8 n=524288: skipped, needs 200 GiB" in text
    assert "target" not in text.lower()


def test_plot_and_render_from_a_results_file(tmp_path):
    path = tmp_path / "decode_attention_h200.json"
    path.write_text(json.dumps(fake_record()))
    bd.main(["--render", str(path)])
    png = (tmp_path / "decode_attention_h200.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "decode_attention_h200.md").read_text() == bd.markdown(fake_record())


def test_plot_needs_a_speedup_row(tmp_path):
    record = fake_record()
    record["results"] = [r for r in record["results"] if not r["row"].startswith("ours-")]
    with pytest.raises(ValueError, match="no ours"):
        bd.plot_speedups(record, str(tmp_path / "x.png"))
