"""Timing for ``benchmarks.decode_loop``: CUDA-event timers, CUDA-graph replays, and the decode loop.

``decode`` runs greedy steps with the argmax fed back on the device, so a timed run synchronises
once, at its end; ``paced_step_ms`` times steps one at a time after the GPU went idle.
"""

from __future__ import annotations

import statistics
import time

import torch


class Timer:
    """Elapsed seconds of a region: CUDA events (one sync at the end) on GPU, perf_counter on CPU.

    ``host_seconds`` is the host's time to issue the region (perf_counter up to the final sync): when
    it is close to ``seconds``, the GPU waited for the host (Python, guards, graph-replay
    bookkeeping), and faster kernels would not show.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc):
        self.host_seconds = time.perf_counter() - self.t0
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def time_replays(fn, device, repeats: int = 10) -> float:
    """Seconds per call of ``fn`` (a whole decode step's attention): CUDA-graph replays, eager if capture fails."""
    if device.type != "cuda":
        fn()
        with Timer(device) as t:
            for _ in range(repeats):
                fn()
        return t.seconds / repeats
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on a side stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # a backend that cannot be captured is timed by eager launches
        torch.cuda.synchronize()
        run = fn
    run()
    with Timer(device) as t:
        for _ in range(repeats):
            run()
    del run
    return t.seconds / repeats


def rewind(cache, valid: int):
    for layer in cache.layers:
        layer.cumulative_length.fill_(valid)


def make_forward(model, mode: str):
    if mode == "reduce-overhead":
        return torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    if mode == "cudagraphs":
        return torch.compile(model.forward, backend="cudagraphs", fullgraph=True)
    if mode == "eager":
        return torch.compile(model.forward, backend="eager", fullgraph=True)
    return model.forward


def decode(forward, cache, first_token, start: int, steps: int, full_mask, device, mark_steps: bool):
    """``steps`` greedy steps from position ``start``; returns the (B, steps) tokens tensor (on the device)."""
    batch = first_token.shape[0]
    token = first_token
    positions = torch.full((batch, 1), start, dtype=torch.long, device=device)
    chosen = []
    for _ in range(steps):
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        out = forward(input_ids=token, attention_mask=full_mask, position_ids=positions, past_key_values=cache,
                      use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        chosen.append(token)
        positions = positions + 1
    return torch.cat(chosen, dim=1)


def paced_step_ms(forward, cache, first_token, start: int, steps: int, full_mask, device, mark_steps: bool) -> float:
    """Median GPU milliseconds of one decode step run alone: each step is issued after the GPU went idle
    (a sync before it) and timed by CUDA events around it. Against the back-to-back ``ms_per_step`` this
    separates what a step costs by itself from what running steps back to back adds or hides (queued
    launches, clocks under sustained load)."""
    times = []
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with Timer(device) as t:
            decode(forward, cache, first_token, start + step, 1, full_mask, device, mark_steps)
        times.append(1e3 * t.seconds)
    return float(statistics.median(times))


def compile_counters():
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
    }
