"""One decode step of one attention layer: dense SDPA against HashAttention's CUDA kernels.

Shape of a Llama-3.1-8B layer (32 query heads, 8 KV heads, head_dim 128, bf16), one query row
per sequence, n cached tokens, batch B. Sparsity s means n / s tokens attended in total, the
sink (128) and local (128) windows included, so the heavy budget is n / s - 256.

Rows (each timed as CUDA-graph replays with CUDA events, median of >= 50 after warm-up; one
graph runs the step on R layers' worth of buffers in turn, as many times over as make at least
32 steps per replay -- a Llama-3.1-8B decode step's layers -- and the time is divided by the
steps. R is chosen so that the buffers hold 8 L2s in all and every buffer is touched again only
after two L2s' worth of the other buffers' bytes even for the step that reads least (the group
selection's signatures), so no row reads from L2 what a model would read from DRAM; see
``layer_buffers`` and ``replay_cycles``):

* ``sdpa-flash`` / ``sdpa-cudnn``: F.scaled_dot_product_attention(enable_gqa=True) over the
  whole cache with that backend; its output is first checked against a float32 reference
  (a backend that is wrong or refuses the shape is dropped and reported); before timing, our
  sparse_attention output is also checked against SDPA over the gathered rows it selected;
* ``naive``: the paper's pipeline in plain PyTorch -- popcount(q XOR k) (SWAR bit counting),
  torch.topk over the heavy candidates, gather of the selected K/V rows, SDPA over them;
* ``ours-per-head``: hamming_topk with per-query-head signatures and selection, then
  sparse_attention (the paper's configuration);
* ``ours-group``: signatures per KV head, selection shared by the 4 query heads of a group
  (each selected K/V row read once for the group);
* ``select-per-head`` / ``select-group``: hamming_topk alone;
* ``attend-per-head`` / ``attend-group``: sparse_attention alone, on indices selected beforehand
  (so the pipeline's time splits into its two ops);
* ``floor-read-<mode>``, ``floor-read-select-<mode>``, ``floor-read-attend-<mode>`` and
  ``floor-empty`` (needs Triton): one kernel that only reads the same bytes as the whole step, the
  selection or the attention, contiguously, and one that writes a single word -- what any kernel
  reading those bytes costs at the least in the same graph setting (scripts/read_floor.py).

The results file then checks the issue's targets (B = 1, 32x) against the run and says for each
miss what bounds it, from these rows (scripts/decode_targets.py).

Our attention calls pass a zeroed ``workspace`` allocated once (as the HF static cache does), so
where the kernel merges its splits through counters no memset precedes it.

Columns: microseconds; GB/s over the bytes the step must read (dense: all K/V; ours: the key
signatures plus the selected K/V rows, per head); % of the byte floor, i.e. bytes / copy
bandwidth measured in the same run over the measured time; speedup over the best dense row.

    python scripts/bench_decode.py --out benchmarks/results       # the full table (H200: ~2 min)
    python scripts/bench_decode.py --ns 8192 --batches 1 --repeats 20   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_targets  # noqa: E402
import hashattention as ha  # noqa: E402
import provenance  # noqa: E402
import read_floor as floors  # noqa: E402

QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SINK, LOCAL = 128, 128
DTYPE = torch.bfloat16
GROUP = QUERY_HEADS // KV_HEADS


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[8192, 32768, 131072, 524288])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sparsities", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--repeats", type=int, default=60, help="timed graph replays (median taken)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--memory-gib", type=float, default=100.0, help="skip configs needing more than this")
    parser.add_argument("--out", default=None, help="directory for bench_decode_<date>.{md,json}")
    return parser.parse_args()


# ---- measurement helpers ------------------------------------------------------------------------

# A replay runs at least this many steps: the layers of one Llama-3.1-8B decode step. A graph
# replay has a fixed cost (~10 µs on an H100, session 46: an empty kernel took 1.4 µs per step with
# 8 steps per replay and 5.1 µs with 2), which a model pays once per 32 layers; dividing it over
# fewer steps charged every row a few µs a model never pays.
MIN_STEPS_PER_REPLAY = 32
# A replay of R steps that already takes this long keeps one pass over the buffers: the fixed cost is
# then under 1% of it, and 32 steps of the slowest rows (the naive pipeline at B = 8) would take minutes.
LONG_REPLAY_US = 2000.0
# Between two uses of one buffer, the other buffers' bytes of the step that reads least pass through
# L2 at least this many times over (so its data has left L2), and all the buffers hold 8 L2s.
L2_PASSES_BETWEEN_USES = 2
L2_MULTIPLE_IN_ALL = 8
MAX_LAYER_BUFFERS = 512


def layer_buffers(layer_bytes_all: int, smallest_step_bytes: int, l2_bytes: int) -> int:
    """How many layers' buffers to rotate over (at least 2, at most MAX_LAYER_BUFFERS).

    layer_bytes_all: every byte of one layer's inputs; smallest_step_bytes: what the row that
    reads least reads per step.
    """
    if layer_bytes_all <= 0 or smallest_step_bytes <= 0 or l2_bytes <= 0:
        raise ValueError("byte counts must be positive")
    in_all = math.ceil(L2_MULTIPLE_IN_ALL * l2_bytes / layer_bytes_all)
    between_uses = 1 + math.ceil(L2_PASSES_BETWEEN_USES * l2_bytes / smallest_step_bytes)
    return max(2, min(MAX_LAYER_BUFFERS, max(in_all, between_uses)))


def probe_buffers(requested: int | None, layer_bytes_all: int, step_bytes: int, l2_bytes: int,
                  memory_bytes: int) -> int:
    """Layer buffers for a probe script: `requested` if given, else layer_buffers' rule for a step
    that reads `step_bytes` of `layer_bytes_all`, cut to what fits in `memory_bytes` (at least 2).
    With a fixed count (the probes used 8), a step reading a few MB found its data in L2 again."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"layers must be >= 1, got {requested}")
        return requested
    fitting = max(2, memory_bytes // layer_bytes_all)
    return min(layer_buffers(layer_bytes_all, step_bytes, l2_bytes), fitting)


def replay_cycles(layers: int, us_per_step: float) -> int:
    """Passes over the `layers` buffers per replay: enough for MIN_STEPS_PER_REPLAY steps, or one
    where a single pass already takes LONG_REPLAY_US."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if us_per_step * layers >= LONG_REPLAY_US:
        return 1
    return max(1, math.ceil(MIN_STEPS_PER_REPLAY / layers))


def time_graph(step, layers: int, repeats: int, warmup: int, cycles: int = 1) -> float:
    """Median microseconds of one step, from replays of a graph running `step(i)` for i < layers,
    `cycles` times over (the time is divided by layers * cycles)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(cycles):
            for i in range(layers):
                step(i)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / (layers * cycles))
    del graph
    return statistics.median(times)


def time_steps(step, layers: int, repeats: int, warmup: int) -> float:
    """time_graph with the passes per replay of replay_cycles, from a short first estimate."""
    estimate = time_graph(step, layers, 3, 1)
    return time_graph(step, layers, repeats, warmup, replay_cycles(layers, estimate))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    The better of a copy kernel (an elementwise add) and a memcpy: inside a CUDA graph a
    memcpy can run on the copy engines, which do not reach the kernels' bandwidth.
    """
    elements = 1 << 29  # 2 GiB of float32
    src = torch.rand(elements, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for copy in (lambda i: torch.add(src, 1.0, out=dst), lambda i: dst.copy_(src)):
        best = min(best, time_graph(copy, 1, 30, 10))
    del src, dst
    return 2 * elements * 4 / (best * 1e-6)


def popcount32(x: torch.Tensor) -> torch.Tensor:
    """Bit count of int32 words (SWAR on int64 so shifts are logical)."""
    x = x.to(torch.int64) & 0xFFFFFFFF
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24


# ---- one configuration ----------------------------------------------------------------------------

class Layers:
    """R layers' worth of decode inputs for one (B, n)."""

    def __init__(self, batch: int, n: int, layers: int, generator: torch.Generator):
        dev = "cuda"
        self.batch, self.n, self.count = batch, n, layers
        self.q = [torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, device=dev, dtype=DTYPE, generator=generator)
                  for _ in range(layers)]
        self.k = [torch.randn(batch, KV_HEADS, n, HEAD_DIM, device=dev, dtype=DTYPE, generator=generator)
                  for _ in range(layers)]
        self.v = [torch.randn(batch, KV_HEADS, n, HEAD_DIM, device=dev, dtype=DTYPE, generator=generator)
                  for _ in range(layers)]

        def signatures(heads, rows):
            return torch.randint(-(2**31), 2**31, (batch, heads, rows, 1), device=dev, dtype=torch.int64,
                                 generator=generator).to(torch.int32)

        self.q_sig = [signatures(QUERY_HEADS, 1) for _ in range(layers)]
        self.k_sig_head = [signatures(QUERY_HEADS, n) for _ in range(layers)]  # per query head (paper)
        self.k_sig_group = [signatures(KV_HEADS, n) for _ in range(layers)]  # per KV head
        self.lengths = torch.full((batch,), n, dtype=torch.int32, device=dev)


def layer_bytes(batch, n):
    kv = 2 * batch * KV_HEADS * n * HEAD_DIM * 2
    sigs = batch * (QUERY_HEADS + KV_HEADS + QUERY_HEADS) * n * 4  # q sig negligible; both key-signature sets
    return kv + sigs


def check_dense(name, out, data: Layers, scale) -> float:
    """Relative error of a dense backend's output for sequence 0 against a float32 reference."""
    q = data.q[0][0].float()  # (Hq, 1, D)
    k = data.k[0][0].float().repeat_interleave(GROUP, 0)
    v = data.v[0][0].float().repeat_interleave(GROUP, 0)
    ref = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v
    return float((out[0].float() - ref).norm() / ref.norm())


def run_config(batch, n, sparsities, args, bandwidth, results, notes):
    scale = HEAD_DIM**-0.5
    per_layer = layer_bytes(batch, n)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    layers = layer_buffers(per_layer, batch * KV_HEADS * n * 4, l2)  # least read: the group selection's signatures
    if layers * per_layer * 1.15 > args.memory_gib * 2**30:
        notes.append(f"B={batch} n={n}: skipped, needs {layers * per_layer * 1.15 / 2**30:.0f} GiB")
        return
    g = torch.Generator(device="cuda")
    g.manual_seed(1000 * batch + n)
    data = Layers(batch, n, layers, g)
    dense_bytes = 2 * batch * KV_HEADS * n * HEAD_DIM * 2

    def record(row, sparsity, us, nbytes, extra=None):
        entry = dict(batch=batch, n=n, sparsity=sparsity, row=row, us=us, bytes=nbytes,
                     gbps=nbytes / (us * 1e-6) / 1e9, floor_pct=100.0 * (nbytes / bandwidth) / (us * 1e-6))
        entry.update(extra or {})
        results.append(entry)
        print(f"B={batch:<2d} n={n:<7d} s={str(sparsity):<4s} {row:<16s} {us:10.1f} us "
              f"{entry['gbps']:8.0f} GB/s {entry['floor_pct']:6.1f} % of floor", flush=True)

    # Dense rows (independent of the sparsity).
    for row, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def dense(i, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(data.q[i], data.k[i], data.v[i], scale=scale, enable_gqa=True)
        try:
            error = check_dense(row, dense(0), data, scale)
        except RuntimeError as exc:
            notes.append(f"B={batch} n={n}: {row} refused the shape ({str(exc).splitlines()[0][:120]})")
            continue
        if not error < 2e-2:
            notes.append(f"B={batch} n={n}: {row} dropped, relative error {error:.2e} against float32")
            continue
        us = time_steps(dense, layers, args.repeats, args.warmup)
        record(row, "-", us, dense_bytes, dict(rel_error=error, layers=layers))

    for sparsity in sparsities:
        total = n // sparsity
        budget = total - SINK - LOCAL
        if budget <= 0:
            continue
        width = SINK + LOCAL + budget
        sel_head_bytes = batch * QUERY_HEADS * n * 4
        sel_group_bytes = batch * KV_HEADS * n * 4
        rows_head_bytes = batch * QUERY_HEADS * width * HEAD_DIM * 2 * 2
        rows_group_bytes = batch * KV_HEADS * width * HEAD_DIM * 2 * 2

        # Zeroed split counters, reused by every call (each leaves them zero), as a serving pipeline or
        # the HF static cache keeps them: the attention then needs no memset node before it.
        workspace = torch.zeros(batch * QUERY_HEADS, dtype=torch.int32, device="cuda")

        def select_head(i):
            return ha.hamming_topk(data.q_sig[i], data.k_sig_head[i], selection_heads=QUERY_HEADS, sink_tokens=SINK,
                                   local_tokens=LOCAL, budget_tokens=budget, lengths=data.lengths)

        def select_group(i):
            return ha.hamming_topk(data.q_sig[i], data.k_sig_group[i], selection_heads=KV_HEADS, sink_tokens=SINK,
                                   local_tokens=LOCAL, budget_tokens=budget, lengths=data.lengths)

        def ours_head(i):
            indices, counts = select_head(i)
            return ha.sparse_attention(data.q[i], data.k[i], data.v[i], indices, counts, scale=scale,
                                       workspace=workspace)

        def ours_group(i):
            indices, counts = select_group(i)
            return ha.sparse_attention(data.q[i], data.k[i], data.v[i], indices, counts, scale=scale,
                                       workspace=workspace)

        kv_rows = torch.arange(QUERY_HEADS, device="cuda") // GROUP  # KV head of each query head
        sink_local = torch.cat([torch.arange(SINK, device="cuda"), torch.arange(n - LOCAL, n, device="cuda")])

        def naive(i):
            q_sig, k_sig = data.q_sig[i], data.k_sig_head[i]  # (B, Hq, 1, 1), (B, Hq, n, 1)
            scores = 32 - popcount32(torch.bitwise_xor(q_sig, k_sig[:, :, SINK:n - LOCAL]).squeeze(-1))
            heavy = torch.topk(scores, budget, dim=-1).indices + SINK  # (B, Hq, m)
            positions = torch.cat([sink_local.expand(batch, QUERY_HEADS, -1), heavy], dim=-1)
            base = (torch.arange(batch, device="cuda")[:, None, None] * KV_HEADS + kv_rows[None, :, None]) * n
            flat = (base + positions).reshape(-1)
            k = data.k[i].reshape(-1, HEAD_DIM).index_select(0, flat).view(batch, QUERY_HEADS, width, HEAD_DIM)
            v = data.v[i].reshape(-1, HEAD_DIM).index_select(0, flat).view(batch, QUERY_HEADS, width, HEAD_DIM)
            return F.scaled_dot_product_attention(data.q[i], k, v, scale=scale)

        def gather_attention(i, indices):
            """SDPA over the K/V rows our selection names (checks our attention at full size)."""
            positions = indices[:, :, 0, :].long()  # (B, Hs, K), no padding at these lengths
            heads = positions.shape[1]
            kv_of_list = torch.arange(heads, device="cuda") // max(1, heads // KV_HEADS)
            base = (torch.arange(batch, device="cuda")[:, None, None] * KV_HEADS + kv_of_list[None, :, None]) * n
            flat = (base + positions).reshape(-1)
            k = data.k[i].reshape(-1, HEAD_DIM).index_select(0, flat).view(batch, heads, width, HEAD_DIM)
            v = data.v[i].reshape(-1, HEAD_DIM).index_select(0, flat).view(batch, heads, width, HEAD_DIM)
            return F.scaled_dot_product_attention(data.q[i], k, v, scale=scale, enable_gqa=heads < QUERY_HEADS)

        for mode, select in (("per-head", select_head), ("group", select_group)):
            indices, counts = select(0)
            if not bool((counts == width).all()):
                notes.append(f"B={batch} n={n} {sparsity}x {mode}: some rows selected fewer than {width} tokens")
            ours = ha.sparse_attention(data.q[0], data.k[0], data.v[0], indices, counts, scale=scale)[0].float()
            expected = gather_attention(0, indices).float()
            error = float((ours - expected).norm() / expected.norm())
            if not error < 2e-2:
                notes.append(f"B={batch} n={n} {sparsity}x {mode}: sparse_attention vs gather+SDPA error {error:.2e}")

        selected = {"per-head": [select_head(i) for i in range(layers)], "group": [select_group(i) for i in range(layers)]}

        def attend_head(i):
            return ha.sparse_attention(data.q[i], data.k[i], data.v[i], *selected["per-head"][i], scale=scale,
                                       workspace=workspace)

        def attend_group(i):
            return ha.sparse_attention(data.q[i], data.k[i], data.v[i], *selected["group"][i], scale=scale,
                                       workspace=workspace)

        for row, step, nbytes in (
            ("naive", naive, sel_head_bytes + rows_head_bytes),
            ("ours-per-head", ours_head, sel_head_bytes + rows_head_bytes),
            ("ours-group", ours_group, sel_group_bytes + rows_group_bytes),
            ("select-per-head", select_head, sel_head_bytes),
            ("select-group", select_group, sel_group_bytes),
            ("attend-per-head", attend_head, rows_head_bytes),
            ("attend-group", attend_group, rows_group_bytes),
        ):
            us = time_steps(step, layers, args.repeats, args.warmup)
            record(row, f"{sparsity}x", us, nbytes, dict(layers=layers))

        if floors.available():
            # What any kernel reading the same bytes costs at the least (scripts/read_floor.py): the
            # signatures, the attended rows' bytes (a contiguous prefix of the K cache, never slower
            # to read than the scattered rows) and both in one launch.
            for mode, signatures, sig_bytes, row_bytes in (
                    ("per-head", data.k_sig_head, sel_head_bytes, rows_head_bytes),
                    ("group", data.k_sig_group, sel_group_bytes, rows_group_bytes)):
                if row_bytes > data.k[0].numel() * data.k[0].element_size():
                    notes.append(f"B={batch} n={n} {sparsity}x {mode}: no read floor, the rows exceed the K cache")
                    continue
                sig_words = [floors.as_words(signatures[i]) for i in range(layers)]
                row_words = [floors.as_words(data.k[i], row_bytes) for i in range(layers)]
                for row, buffers, nbytes in (
                        (f"floor-read-{mode}", [[a, b] for a, b in zip(sig_words, row_words)], sig_bytes + row_bytes),
                        (f"floor-read-select-{mode}", [[a] for a in sig_words], sig_bytes),
                        (f"floor-read-attend-{mode}", [[b] for b in row_words], row_bytes)):
                    record(row, f"{sparsity}x", floors.time_read(buffers, time_steps, args.repeats), nbytes,
                           dict(layers=layers))
    if floors.available():
        record("floor-empty", "-", floors.time_empty(time_steps, layers, args.repeats), 0, dict(layers=layers))
    else:
        notes.append(f"B={batch} n={n}: no floor rows (Triton is missing)")
    del data
    torch.cuda.empty_cache()


def add_speedups(results):
    best_dense = {}
    for r in results:
        if r["row"].startswith("sdpa"):
            key = (r["batch"], r["n"])
            best_dense[key] = min(best_dense.get(key, float("inf")), r["us"])
    for r in results:
        dense = best_dense.get((r["batch"], r["n"]))
        # An empty launch reads nothing: a ratio to dense would say nothing about any step.
        r["speedup"] = dense / r["us"] if dense and r["row"] != "floor-empty" else None


def markdown(results, meta, notes) -> str:
    def fmt_n(n):
        return f"{n // 1024}K"

    lines = [f"# Decode attention, one Llama-3.1-8B layer ({meta['gpu']})", ""]
    lines += [f"- date: {meta['date']}", f"- GPU: {meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}",
              f"- command: `{meta['command']}`",
              f"- code: {provenance.label(meta['code'])}" if "code" in meta else "- code: not recorded",
              f"- copy bandwidth (read + write) measured in this run: {meta['copy_bandwidth_gbps']:.0f} GB/s"]
    if "replay" in meta:
        replay = meta["replay"]
        lines.append(f"- timing: graph replays of >= {replay['min_steps']} steps (one pass over the layer buffers where "
                     f"it takes >= {replay['long_replay_us']:.0f} µs), buffers rotated so that each is reused only after "
                     f"{replay['l2_passes_between_uses']} L2s of other bytes of the least-reading step")
    lines.append("")
    headline = [r for r in results if r["batch"] == 1 and r["sparsity"] in ("-", "32x")]
    if headline:
        lines += ["## Headline: B = 1, 32x (speedup over the best dense SDPA row)", "",
                  "| n | best dense µs | ours per-head µs | speedup | ours group µs | speedup | select per-head µs |",
                  "|---|---|---|---|---|---|---|"]
        for n in sorted({r["n"] for r in headline}):
            by_row = {r["row"]: r for r in headline if r["n"] == n}
            dense = min((r["us"] for k, r in by_row.items() if k.startswith("sdpa")), default=float("nan"))

            def cell(row, field="us"):
                r = by_row.get(row)
                return "-" if r is None else (f"{r[field]:.1f}" if field == "us" else f"{r[field]:.2f}x")
            lines.append(f"| {fmt_n(n)} | {dense:.1f} | {cell('ours-per-head')} | {cell('ours-per-head', 'speedup')} | "
                         f"{cell('ours-group')} | {cell('ours-group', 'speedup')} | {cell('select-per-head')} |")
        lines.append("")
    lines += decode_targets.markdown(results)
    lines += ["## All rows", "", "| B | n | sparsity | row | µs | GB/s | % of byte floor | speedup vs best dense |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        lines.append(f"| {r['batch']} | {fmt_n(r['n'])} | {r['sparsity']} | {r['row']} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {r['floor_pct']:.1f} | {speedup} |")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    assert torch.cuda.is_available() and ha.WITH_CUDA, "needs a GPU and the CUDA kernels"
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    results, notes = [], []
    for batch in args.batches:
        for n in args.ns:
            run_config(batch, n, args.sparsities, args, bandwidth, results, notes)
    add_speedups(results)
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        command="python " + " ".join(sys.argv),
        code=provenance.describe(),
        copy_bandwidth_gbps=bandwidth / 1e9,
        replay=dict(min_steps=MIN_STEPS_PER_REPLAY, long_replay_us=LONG_REPLAY_US,
                    l2_passes_between_uses=L2_PASSES_BETWEEN_USES, l2_multiple_in_all=L2_MULTIPLE_IN_ALL),
        shape=dict(query_heads=QUERY_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE), sink=SINK,
                   local=LOCAL),
    )
    text = markdown(results, meta, notes)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
        with open(os.path.join(args.out, f"bench_decode_{stamp}.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, f"bench_decode_{stamp}.json"), "w") as f:
            json.dump(dict(meta=meta, results=results, notes=notes, targets=decode_targets.evaluate(results)), f,
                      indent=1)


if __name__ == "__main__":
    main()
