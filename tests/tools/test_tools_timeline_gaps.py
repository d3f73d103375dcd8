"""tools.timeline_gaps on synthetic Chrome traces: idle time, its sources and the host state (no GPU needed)."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from tools import timeline_gaps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = [sys.executable, "-m", "tools.timeline_gaps"]


def kernel(name, ts, dur, correlation, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": stream}}


def runtime(name, ts, dur, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def trace():
    """Two steps' worth of a made-up timeline (µs).

    A 0-10 (eager launch at 0), B 15-20 launched at 12 (after A ended: a host-bound gap of 5), a graph
    launched at 1 whose kernels C 30-40 and D 40.5-50 run later (a device-side gap of 10, then 0.5 below
    the floor), E on a second stream 45-60 overlapping D, and a memcpy 61-62 with no known launch.
    """
    return [
        runtime("cudaLaunchKernel", 0, 1, 1), kernel("void ns::a_kernel<float, 4>(float*, int)", 0, 10, 1),
        runtime("cudaGraphLaunch", 1, 2, 2), kernel("void c_kernel(int)", 30, 10, 2), kernel("d", 40.5, 9.5, 2),
        runtime("cudaLaunchKernel", 12, 2, 3), kernel("b_kernel", 15, 5, 3),
        runtime("cudaLaunchKernel", 13, 1, 4), kernel("e_kernel", 45, 15, 4, stream=9),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 61, "dur": 1, "args": {"correlation": 99}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host ops are not GPU time
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5},  # not a complete event
    ]


def test_idle_time_and_its_sources():
    s = timeline_gaps.summarize(trace(), steps=2, floor_us=1.0)
    assert s["gpu_events"] == 6
    assert s["span_us_per_step"] == pytest.approx(62 / 2)
    busy = 10 + 5 + (10 + 9.5 + 10) + 1  # A, B, C..E merged over both streams (40.5-60 is covered), memcpy
    assert s["busy_us_per_step"] == pytest.approx(busy / 2)
    assert s["idle_us_per_step"] == pytest.approx((62 - busy) / 2)
    # attributed: A->B 5, B->C 10, E->memcpy 1; C->D 0.5 is below the floor
    assert s["idle_attributed_us_per_step"] == pytest.approx(16 / 2)
    gaps = {(g["after"], g["before"]): g for g in s["top_gaps"]}
    assert set(gaps) == {("a_kernel", "b_kernel"), ("b_kernel", "c_kernel"), ("e_kernel", "Memcpy DtoD")}
    assert gaps[("b_kernel", "c_kernel")]["launched_by"] == "cudaGraphLaunch"
    assert gaps[("b_kernel", "c_kernel")]["host"] == "issued before idle"
    assert gaps[("a_kernel", "b_kernel")]["host"] == "issued after idle"
    assert gaps[("e_kernel", "Memcpy DtoD")]["host"] == "unknown"
    assert s["top_gaps"][0]["us_per_step"] == pytest.approx(5.0) and s["top_gaps"][0]["max_us"] == 10
    assert s["idle_us_per_step_by_host_state"] == pytest.approx(
        {"issued before idle": 5.0, "issued after idle": 2.5, "unknown": 0.5})
    calls = {r["call"]: r for r in s["runtime_calls"]}
    assert calls["cudaLaunchKernel"]["per_step"] == 1.5 and calls["cudaLaunchKernel"]["us_per_step"] == 2.0
    assert calls["cudaGraphLaunch"]["max_us"] == 2


def test_floor_and_empty_trace():
    s = timeline_gaps.summarize(trace(), steps=1, floor_us=0.25)
    assert s["idle_attributed_us_per_step"] == pytest.approx(16.5)  # now C->D counts too
    assert timeline_gaps.summarize([runtime("cudaMalloc", 0, 3, 1)], steps=1)["gpu_events"] == 0
    with pytest.raises(ValueError, match="steps"):
        timeline_gaps.summarize(trace(), steps=0)


@pytest.mark.parametrize("name, short", [
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)",
     "cunn_SoftMaxForward"),
    ("void hashattention::cuda::resident_select_kernel<2>(hashattention::cuda::Args)", "resident_select_kernel"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_TNT", "nvjet_tst_128x64_64x8_1x2_h_bz_TNT"),
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD"),
])
def test_short_names(name, short):
    assert timeline_gaps.short_name(name) == short


def test_cli_reads_gzipped_trace(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": trace()}, f)
    done = subprocess.run([*COMMAND, str(path), "--steps", "2"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "span 31.0 us" in done.stdout and "b_kernel -> c_kernel | cudaGraphLaunch, issued before idle" in done.stdout


def test_graph_replays():
    """Per replay of a CUDA graph (kernels share its launch's correlation id): medians of its kernels, span,
    kernel time and idle time inside it, and of the idle time since the previous replay's last kernel."""
    assert timeline_gaps.summarize(trace(), steps=2)["graph_replays"] == {
        "replays": 1, "kernels": 2, "span_us": 20, "kernel_us": 19.5, "idle_inside_us": 0.5, "idle_before_us": None}
    events = []
    for i, (start, gap) in enumerate([(100, 3), (200, 1), (300, 2)]):  # three replays of two kernels each
        events += [runtime("cudaGraphLaunch", start - 90, 5, 10 + i), kernel("x", start, 40, 10 + i),
                   kernel("y", start + 40 + gap, 50, 10 + i)]
    events.append(kernel("eager", 195, 2, 99))  # between replays; not part of one
    replays = timeline_gaps.summarize(events, steps=3)["graph_replays"]
    assert replays["replays"] == 3 and replays["kernels"] == 2 and replays["kernel_us"] == 90
    assert replays["span_us"] == 92 and replays["idle_inside_us"] == 2  # medians of 93/91/92 and 3/1/2
    assert replays["idle_before_us"] == pytest.approx((200 - 193 + 300 - 291) / 2)  # median of two: 7 and 9


def replays_of(gaps_by_replay, correlation0=10):
    """Graph replays of kernels x, y, z with the given (x -> y, y -> z) gaps in µs."""
    events = []
    for i, (gap_xy, gap_yz) in enumerate(gaps_by_replay):
        start, c = 100 * (i + 1), correlation0 + i
        events += [runtime("cudaGraphLaunch", start - 50, 5, c), kernel("x", start, 10, c),
                   kernel("y", start + 10 + gap_xy, 20, c), kernel("z", start + 30 + gap_xy + gap_yz, 5, c)]
    events.append(kernel("eager", 5000, 2, 99))  # outside any replay: no transition
    return events


def test_replay_transitions_and_their_comparison(tmp_path):
    """Gaps between graph nodes per (kernel, next kernel), negative where the next started early, and
    the comparison of two traces ordered by the idle time per replay they differ by."""
    first = replays_of([(1.0, 0.5), (3.0, 0.5), (2.0, 0.5)])
    second = replays_of([(0.5, -0.25), (0.5, -0.25)])
    t = timeline_gaps.replay_transitions(first)
    assert t["replays"] == 3 and t["transitions"] == {("x", "y"): [1.0, 3.0, 2.0], ("y", "z"): [0.5, 0.5, 0.5]}
    rows = timeline_gaps.compare_transitions(first, second)
    assert [(r["after"], r["before"]) for r in rows] == [("x", "y"), ("y", "z")]
    assert rows[0]["median_us"] == [2.0, 0.5] and rows[0]["idle_diff_us_per_replay"] == pytest.approx(1.5)
    assert rows[1]["median_us"] == [0.5, -0.25] and rows[1]["idle_diff_us_per_replay"] == pytest.approx(0.75)
    assert rows[0]["per_replay"] == 1
    with pytest.raises(ValueError, match="both traces need CUDA-graph replays"):
        timeline_gaps.compare_transitions(first, [kernel("eager", 0, 1, 1)])
    paths = []
    for name, events in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps({"traceEvents": events}))
        paths.append(str(tmp_path / name))
    done = subprocess.run([*COMMAND, paths[0], "--compare", paths[1]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "1.5    1.0    2.00 /    0.50 | x -> y" in done.stdout
