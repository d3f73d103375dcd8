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
``benchmarks.common.layer_buffers`` and ``replay_cycles``):

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
  reading those bytes costs at the least in the same graph setting (``benchmarks.read_floor``).

Our attention calls pass a zeroed ``workspace`` allocated once (as the HF static cache does), so
where the kernel merges its splits through counters no memset precedes it.

Columns: microseconds; GB/s over the bytes the step must read (dense: all K/V; ours: the key
signatures plus the selected K/V rows, per head); % of the byte floor, i.e. bytes / copy
bandwidth measured in the same run over the measured time; speedup over the best dense row of
the same run. The results go to ``benchmarks/results/decode_attention_<gpu>.{md,json,png}`` (the
plot: speedup over dense against the context length, per mode), replacing an earlier run's.

    python -m benchmarks.decode_attention                              # the full table (H200: ~2 min)
    python -m benchmarks.decode_attention --ns 8192 --batches 1 --repeats 20 --out /tmp/quick
    python -m benchmarks.decode_attention --render benchmarks/results/decode_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hashattention as ha
from benchmarks import common
from benchmarks import read_floor as floors
from benchmarks.common import layer_buffers, time_graph, time_steps

BENCHMARK = "decode_attention"
QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SINK, LOCAL = 128, 128
DTYPE = torch.bfloat16
GROUP = QUERY_HEADS // KV_HEADS
MODES = ("per-head", "group")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[8192, 32768, 131072, 524288])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sparsities", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--repeats", type=int, default=60, help="timed graph replays (median taken)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--memory-gib", type=float, default=100.0, help="skip configs needing more than this")
    parser.add_argument("--out", default=None,
                        help="folder of decode_attention_<gpu>.{md,json,png} (default: benchmarks/results)")
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="no measurement: rewrite the Markdown table and the plot of this results file "
                             "(beside it; no GPU needed)")
    return parser.parse_args(argv)


# ---- measurement helpers ------------------------------------------------------------------------

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
            # What any kernel reading the same bytes costs at the least (benchmarks.read_floor): the
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


def add_speedups(results: List[dict]) -> None:
    """Sets each row's ``speedup``: the best dense (sdpa-*) row of its (batch, n) over its time
    (None where the run has no dense row, and for the empty launch, which reads nothing)."""
    best_dense: Dict[tuple, float] = {}
    for r in results:
        if r["row"].startswith("sdpa"):
            key = (r["batch"], r["n"])
            best_dense[key] = min(best_dense.get(key, float("inf")), r["us"])
    for r in results:
        dense = best_dense.get((r["batch"], r["n"]))
        r["speedup"] = dense / r["us"] if dense and r["row"] != "floor-empty" else None


def human_n(n: int) -> str:
    return f"{n // 1024}K"


def find_row(results: List[dict], batch: int, n: int, sparsity: str, row: str) -> Optional[dict]:
    return next((r for r in results if (r["batch"], r["n"], r["sparsity"], r["row"]) == (batch, n, sparsity, row)),
                None)


def headline_lines(results: List[dict], batch: int, sparsity: str) -> List[str]:
    """Speedup over the best dense row, and the time against the read floor, at one (B, sparsity)."""
    ns = sorted({r["n"] for r in results if r["batch"] == batch and r["sparsity"] == sparsity})
    if not ns:
        return []

    def us(n, row, sparse=True):
        r = find_row(results, batch, n, sparsity if sparse else "-", row)
        return None if r is None else r["us"]

    def cell(value, spec=".1f", suffix=""):
        return "-" if value is None else f"{value:{spec}}{suffix}"

    lines = [f"## B = {batch}, {sparsity}: speedup over the best dense SDPA row", "",
             "| n | best dense µs | ours per-head µs | speedup | ours group µs | speedup | select per-head µs "
             "| attend per-head µs |",
             "|---|---|---|---|---|---|---|---|"]
    for n in ns:
        dense = min((r["us"] for r in results if r["batch"] == batch and r["n"] == n and r["row"].startswith("sdpa")),
                    default=None)
        head, group = us(n, "ours-per-head"), us(n, "ours-group")
        lines.append(f"| {human_n(n)} | {cell(dense)} | {cell(head)} | "
                     f"{cell(dense / head if dense and head else None, '.2f', 'x')} | {cell(group)} | "
                     f"{cell(dense / group if dense and group else None, '.2f', 'x')} | "
                     f"{cell(us(n, 'select-per-head'))} | {cell(us(n, 'attend-per-head'))} |")
    floored = [(n, mode) for n in ns for mode in MODES if us(n, f"floor-read-{mode}") is not None]
    if floored:
        empty = {n: us(n, "floor-empty", sparse=False) for n in ns}
        lines += ["", f"## B = {batch}, {sparsity}: against the read floor", "",
                  "The floor of a row is one kernel that reads the same bytes once, contiguously, timed the same way "
                  "(`benchmarks.read_floor`); an empty launch shows what any kernel costs in this setting.", "",
                  "| n | mode | ours µs | floor µs | x floor | select µs | its floor | attend µs | its floor "
                  "| empty launch µs |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for n, mode in floored:
            ours, floor = us(n, f"ours-{mode}"), us(n, f"floor-read-{mode}")
            lines.append(f"| {human_n(n)} | {mode} | {cell(ours)} | {cell(floor)} | "
                         f"{cell(ours / floor if ours and floor else None, '.2f', 'x')} | "
                         f"{cell(us(n, f'select-{mode}'))} | {cell(us(n, f'floor-read-select-{mode}'))} | "
                         f"{cell(us(n, f'attend-{mode}'))} | {cell(us(n, f'floor-read-attend-{mode}'))} | "
                         f"{cell(empty[n])} |")
    return lines + [""]


def markdown(record: dict) -> str:
    """The results file's Markdown: header, headline tables (B = 1, 32x), then every row."""
    meta, results, notes = record["meta"], record["results"], record.get("notes", [])
    lines = [f"# Decode attention, one Llama-3.1-8B layer ({meta['device']})", "", *common.header_lines(meta),
             f"- copy bandwidth (read + write) measured in this run: {meta['copy_bandwidth_gbps']:.0f} GB/s"]
    replay = meta.get("replay")
    if replay:
        lines.append(f"- timing: graph replays of >= {replay['min_steps']} steps (one pass over the layer buffers "
                     f"where it takes >= {replay['long_replay_us']:.0f} µs), buffers rotated so that each is reused "
                     f"only after {replay['l2_passes_between_uses']} L2s of other bytes of the least-reading step")
    lines.append("- plot: the `.png` file of the same name (speedup over the best dense row against the context "
                 "length)")
    lines.append("")
    lines += headline_lines(results, 1, "32x")
    lines += ["## All rows", "", "| B | n | sparsity | row | µs | GB/s | % of byte floor | speedup vs best dense |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        lines.append(f"| {r['batch']} | {human_n(r['n'])} | {r['sparsity']} | {r['row']} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {r['floor_pct']:.1f} | {speedup} |")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def plot_speedups(record: dict, path: str) -> None:
    """A PNG of the speedup over the best dense row against n: one panel per batch size, one line per
    (mode, sparsity) -- a colour per mode, dashed at 16x, solid at 32x -- and the dense baseline at 1x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = record["results"]
    batches = sorted({r["batch"] for r in results if r.get("speedup") and r["row"].startswith("ours-")})
    if not batches:
        raise ValueError("no ours-* row with a speedup to plot")
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 4.0), squeeze=False, sharey=True)
    for ax, batch in zip(axes[0], batches):
        for mode, marker, color in zip(MODES, ("o", "s"), ("tab:blue", "tab:red")):
            for sparsity, style in (("16x", "--"), ("32x", "-")):
                points = sorted((r["n"], r["speedup"]) for r in results if r["batch"] == batch
                                and r["row"] == f"ours-{mode}" and r["sparsity"] == sparsity and r.get("speedup"))
                if points:
                    ax.plot([n for n, _ in points], [x for _, x in points], style, marker=marker, color=color,
                            label=f"{mode}, {sparsity}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["n"] for r in results if r["batch"] == batch})
        ax.set_xticks(ticks, [human_n(n) for n in ticks])
        ax.set_xlabel("context length n (tokens)")
        ax.set_title(f"B = {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speedup over the best dense SDPA")
    fig.suptitle(f"Decode attention, one Llama-3.1-8B layer, {record['meta']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(record: dict, json_path: str) -> None:
    """The JSON, Markdown and PNG results beside each other (``<stem>.json``, ``.md``, ``.png``)."""
    stem = json_path[: -len(".json")]
    common.write_results(stem + ".md", json_path, markdown(record), record)
    plot_speedups(record, stem + ".png")


def render(json_path: str) -> None:
    """Rewrite the Markdown and the plot of an existing results file from its JSON."""
    with open(json_path) as f:
        record = json.load(f)
    stem = json_path[: -len(".json")]
    common.write_text(stem + ".md", markdown(record))
    plot_speedups(record, stem + ".png")
    print(f"wrote {stem}.md and {stem}.png")


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    if not (torch.cuda.is_available() and ha.WITH_CUDA):
        raise SystemExit("benchmarks.decode_attention needs a GPU and the extension built with its CUDA kernels")
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    results, notes = [], []
    for batch in args.batches:
        for n in args.ns:
            run_config(batch, n, args.sparsities, args, bandwidth, results, notes)
    add_speedups(results)
    meta = common.run_metadata(common.command_line(f"benchmarks.{BENCHMARK}", argv))
    meta.update(
        copy_bandwidth_gbps=bandwidth / 1e9,
        replay=dict(min_steps=common.MIN_STEPS_PER_REPLAY, long_replay_us=common.LONG_REPLAY_US,
                    l2_passes_between_uses=common.L2_PASSES_BETWEEN_USES,
                    l2_multiple_in_all=common.L2_MULTIPLE_IN_ALL),
        shape=dict(query_heads=QUERY_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE), sink=SINK,
                   local=LOCAL),
    )
    record = dict(meta=meta, results=results, notes=notes)
    print(markdown(record))
    _, json_path = common.results_paths(BENCHMARK, common.device_kind(), args.out)
    write_outputs(record, json_path)
    print(f"wrote {json_path[:-5]}.{{md,json,png}}")


if __name__ == "__main__":
    main()
