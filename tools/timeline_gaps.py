"""Where a GPU timeline is idle: gaps between kernels in a torch.profiler (Kineto) Chrome trace.

The kernel time of a decode step can match its wall time or fall short of it; the difference is GPU
idle time. This finds where the idle time sits: between which kernels, and whether the host had
already issued the next kernel (or CUDA-graph replay) when the GPU went idle (a device-side gap:
graph-launch latency, stream waits) or issued it only later (a host-bound gap: Python, guards,
allocator, synchronisation). It also totals the CUDA runtime calls, so that a call that blocks the
host (a full launch queue shows up as a long ``cudaGraphLaunch``/``cudaLaunchKernel``, a sync as
``cudaStreamSynchronize``/``cudaMemcpyAsync``) stands out, and summarizes each CUDA-graph replay (kernels,
span, kernel time, idle time inside it and before it).

    python -m tools.timeline_gaps trace.json.gz --steps 16       # a trace written by export_chrome_trace
    python -m tools.timeline_gaps A.json.gz --compare B.json.gz  # two runs of one graph, node by node

``python -m benchmarks.decode_loop --trace-dir DIR`` writes one trace per method and stores this
summary in its JSON.
Timestamps: Kineto puts GPU activity on the host's clock, so host/GPU comparisons are good to about
a microsecond, which is why gaps below ``floor_us`` are not attributed.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from typing import Dict, Iterable, List, Optional

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")


def short_name(name: str, width: int = 56) -> str:
    """A kernel's name without namespaces, template arguments and parameters (``void a::b<c>(d)`` -> ``b``)."""
    text = re.sub(r"^void ", "", name).replace("->", " to ")  # "->" would close a bracket
    depth, out = 0, []
    for ch in text:  # drop <...> and (...) at any depth
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    text = "".join(out).strip() or name
    return text.split("::")[-1][:width]


def load_events(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def _complete(events: Iterable[dict], categories) -> List[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories and "dur" in e]


def summarize(events: List[dict], steps: int, floor_us: float = 1.0, top: int = 12) -> Dict[str, object]:
    """Busy and idle GPU time per step over the traced region, the largest gap sources, the runtime calls.

    ``events``: Chrome-trace events (``traceEvents``); ``steps``: decode steps in the trace (values are
    divided by it). Gaps are grouped by (previous kernel, next kernel, how the next was launched,
    whether the host issued it before the GPU went idle).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    gpu = sorted(_complete(events, GPU_CATEGORIES), key=lambda e: e["ts"])
    host = _complete(events, HOST_CATEGORIES)
    launch_by_correlation = {e["args"]["correlation"]: e for e in host
                             if isinstance(e.get("args"), dict) and "correlation" in e["args"]}
    calls: Dict[str, Dict[str, float]] = {}
    for e in host:
        c = calls.setdefault(e["name"], {"count": 0, "total_us": 0.0, "max_us": 0.0})
        c["count"] += 1
        c["total_us"] += e["dur"]
        c["max_us"] = max(c["max_us"], e["dur"])
    runtime = sorted(({"call": k, "per_step": v["count"] / steps, "us_per_step": v["total_us"] / steps,
                       "max_us": v["max_us"]} for k, v in calls.items()), key=lambda r: -r["us_per_step"])
    if not gpu:
        return {"steps": steps, "gpu_events": 0, "runtime_calls": runtime[:top]}

    busy = idle_attributed = 0.0
    groups: Dict[tuple, Dict[str, float]] = {}
    start, end = gpu[0]["ts"], gpu[0]["ts"] + gpu[0]["dur"]
    last_name, busy_start = gpu[0]["name"], start
    for e in gpu[1:]:
        e_end = e["ts"] + e["dur"]
        if e["ts"] > end:  # the GPU was idle from `end` to e["ts"]
            busy += end - busy_start
            gap = e["ts"] - end
            if gap >= floor_us:
                launch = launch_by_correlation.get((e.get("args") or {}).get("correlation"))
                call = launch["name"] if launch else "?"
                issued_before_idle = launch is not None and launch["ts"] + launch["dur"] <= end
                key = (short_name(last_name), short_name(e["name"]), call,
                       "issued before idle" if issued_before_idle else "issued after idle" if launch else "unknown")
                g = groups.setdefault(key, {"count": 0, "total_us": 0.0, "max_us": 0.0})
                g["count"] += 1
                g["total_us"] += gap
                g["max_us"] = max(g["max_us"], gap)
                idle_attributed += gap
            busy_start = e["ts"]
        if e_end >= end:
            end, last_name = e_end, e["name"]
    busy += end - busy_start
    span = end - start
    gaps = sorted(({"after": k[0], "before": k[1], "launched_by": k[2], "host": k[3],
                    "per_step": v["count"] / steps, "us_per_step": v["total_us"] / steps, "max_us": v["max_us"]}
                   for k, v in groups.items()), key=lambda g: -g["us_per_step"])
    by_host: Dict[str, float] = {}
    for g in gaps:
        by_host[g["host"]] = by_host.get(g["host"], 0.0) + g["us_per_step"]
    return {
        "steps": steps, "gpu_events": len(gpu), "span_us_per_step": span / steps,
        "busy_us_per_step": busy / steps, "idle_us_per_step": (span - busy) / steps,
        "idle_attributed_us_per_step": idle_attributed / steps, "gap_floor_us": floor_us,
        "idle_us_per_step_by_host_state": by_host, "top_gaps": gaps[:top], "runtime_calls": runtime[:top],
        "graph_replays": graph_replays(gpu, host),
    }


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def replay_members(gpu: List[dict], host: List[dict]) -> List[List[dict]]:
    """The GPU events of each CUDA-graph replay (``cudaGraphLaunch``; its kernels carry the launch's
    correlation id), in launch order, each replay's events in time order; replays without any left out."""
    launches = sorted((e for e in host if e["name"] == "cudaGraphLaunch"), key=lambda e: e["ts"])
    members: Dict[object, List[dict]] = {e["args"].get("correlation"): [] for e in launches
                                          if isinstance(e.get("args"), dict)}
    for e in gpu:
        correlation = (e.get("args") or {}).get("correlation")
        if correlation in members:
            members[correlation].append(e)
    return [sorted(kernels, key=lambda e: e["ts"]) for kernels in members.values() if kernels]


def graph_replays(gpu: List[dict], host: List[dict]) -> Dict[str, object]:
    """CUDA-graph replays: how many, and the medians of kernels per replay, span (first kernel start to
    last end), kernel time, idle time inside the span, and the idle time before each replay's first
    kernel since the previous replay's last one."""
    replays = []
    for kernels in replay_members(gpu, host):
        start, end = min(k["ts"] for k in kernels), max(k["ts"] + k["dur"] for k in kernels)
        replays.append((start, end, len(kernels), sum(k["dur"] for k in kernels)))
    replays.sort()
    if not replays:
        return {"replays": 0}
    before = [b[0] - a[1] for a, b in zip(replays, replays[1:])]
    return {
        "replays": len(replays),
        "kernels": _median([r[2] for r in replays]),
        "span_us": _median([r[1] - r[0] for r in replays]),
        "kernel_us": _median([r[3] for r in replays]),
        "idle_inside_us": _median([r[1] - r[0] - r[3] for r in replays]),
        "idle_before_us": _median(before) if before else None,
    }


def replay_transitions(events: List[dict]) -> Dict[str, object]:
    """The gaps between consecutive kernels inside CUDA-graph replays, grouped by (kernel, next kernel).

    Returns ``{"replays": R, "transitions": {(after, before): [gap_us, ...]}}``. A negative gap means
    the next kernel started before the previous one ended (a programmatic launch). Inside a replay the
    host has issued everything, so these gaps are the GPU's own launch latency between graph nodes.
    """
    replays = replay_members(_complete(events, GPU_CATEGORIES), _complete(events, HOST_CATEGORIES))
    transitions: Dict[tuple, List[float]] = {}
    for kernels in replays:
        for a, b in zip(kernels, kernels[1:]):
            key = (short_name(a["name"]), short_name(b["name"]))
            transitions.setdefault(key, []).append(b["ts"] - (a["ts"] + a["dur"]))
    return {"replays": len(replays), "transitions": transitions}


def compare_transitions(first: List[dict], second: List[dict], top: int = 20) -> List[Dict[str, object]]:
    """Per (kernel, next kernel) transition found in the replays of both traces: how often it occurs per
    replay and its median gap in each, ordered by the difference in idle time per replay (first minus
    second), largest first. Tells whether two runs of the same graph differ in a few places or
    uniformly at every node."""
    a, b = replay_transitions(first), replay_transitions(second)
    if not a["replays"] or not b["replays"]:
        raise ValueError("compare_transitions: both traces need CUDA-graph replays "
                         f"(found {a['replays']} and {b['replays']})")
    rows = []
    for key, gaps in a["transitions"].items():
        other = b["transitions"].get(key)
        if not other:
            continue
        rows.append({"after": key[0], "before": key[1], "per_replay": len(gaps) / a["replays"],
                     "median_us": [_median(gaps), _median(other)],
                     "idle_diff_us_per_replay": sum(gaps) / a["replays"] - sum(other) / b["replays"]})
    rows.sort(key=lambda r: -r["idle_diff_us_per_replay"])
    return rows[:top]


def render_comparison(rows: List[Dict[str, object]]) -> str:
    lines = ["transition gaps inside replays (idle us per replay first - second, per replay, median us first / "
             "second | after -> before):"]
    for r in rows:
        lines.append(f"  {r['idle_diff_us_per_replay']:8.1f} {r['per_replay']:6.1f} {r['median_us'][0]:7.2f} / "
                     f"{r['median_us'][1]:7.2f} | {r['after']} -> {r['before']}")
    return "\n".join(lines)


def render(summary: Dict[str, object]) -> str:
    """Plain-text report of ``summarize``'s result."""
    if not summary.get("gpu_events"):
        return "no GPU activity in the trace"
    lines = [f"per step over {summary['steps']} steps: span {summary['span_us_per_step']:.1f} us, busy "
             f"{summary['busy_us_per_step']:.1f}, idle {summary['idle_us_per_step']:.1f} "
             f"(gaps >= {summary['gap_floor_us']} us: {summary['idle_attributed_us_per_step']:.1f})",
             "idle by host state: " + ", ".join(f"{k} {v:.1f} us" for k, v in
                                               summary["idle_us_per_step_by_host_state"].items()),
             "largest gap sources (us per step, gaps per step, max us | after -> before | launch, host):"]
    for g in summary["top_gaps"]:
        lines.append(f"  {g['us_per_step']:8.1f} {g['per_step']:6.2f} {g['max_us']:8.1f} | {g['after']} -> "
                     f"{g['before']} | {g['launched_by']}, {g['host']}")
    g = summary.get("graph_replays") or {}
    if g.get("replays"):
        lines.append(f"CUDA-graph replays: {g['replays']}, medians: {g['kernels']:g} kernels, span {g['span_us']:.1f} us, "
                     f"kernels {g['kernel_us']:.1f} us, idle inside {g['idle_inside_us']:.1f} us, idle before "
                     + ("-" if g["idle_before_us"] is None else f"{g['idle_before_us']:.1f} us"))
    lines.append("runtime calls (us per step, calls per step, max us):")
    for r in summary["runtime_calls"]:
        lines.append(f"  {r['us_per_step']:8.1f} {r['per_step']:8.2f} {r['max_us']:9.1f}  {r['call']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.timeline_gaps", description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="Chrome trace (.json or .json.gz) from torch.profiler's export_chrome_trace")
    parser.add_argument("--steps", type=int, default=1, help="decode steps in the trace (values are per step)")
    parser.add_argument("--floor-us", type=float, default=1.0, help="smallest gap attributed to a source")
    parser.add_argument("--top", type=int, default=12, help="rows per table")
    parser.add_argument("--compare", metavar="TRACE", default=None,
                        help="a second trace of the same graph: compare the gaps between graph nodes instead")
    args = parser.parse_args(argv)
    if args.compare:
        print(render_comparison(compare_transitions(load_events(args.trace), load_events(args.compare), args.top)))
        return
    print(render(summarize(load_events(args.trace), args.steps, args.floor_us, args.top)))


if __name__ == "__main__":
    main()
