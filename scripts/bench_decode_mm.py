"""The weight GEMMs of a decode step: ``torch.mm`` (cuBLAS) against ``hashattention.ops.decode_mm``.

At decode time each of a Llama layer's GEMMs multiplies B rows by a frozen weight (``weight.t()``,
column-major), so it is a read of the weight. Shapes of Llama-3.1-8B (hidden 4096, intermediate
14336, vocab 128256, 32 query / 8 KV heads of 128), bf16, with the merges of
``hashattention.compile_options.decode_compile_options()`` (q | k | v and gate | up one GEMM each):

* ``qkv`` 4096 -> 6144, ``o`` 4096 -> 4096, ``gate_up`` 4096 -> 28672, ``down`` 14336 -> 4096, ``lm_head``
  4096 -> 128256;
* ``step``: the 32 layers' four GEMMs and the lm_head in order, each layer with its own weights (15 GB),
  i.e. every weight read of one decode step.

Each row is checked against a float64 product first (both kernels), then timed as CUDA-graph replays
with CUDA events (median of ``--repeats``); single-GEMM rows rotate over enough weight copies that they
exceed L2. Columns: µs per GEMM, GB/s over the weight bytes, % of the copy bandwidth measured in the same
run, and decode_mm's speedup over torch.mm.

    python scripts/bench_decode_mm.py --batches 1,4 --out benchmarks/results    # H200: ~1 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hashattention.ops as ops  # noqa: E402
import provenance  # noqa: E402
from bench_decode import copy_bandwidth, time_graph  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 4096, 14336, 128256, 32
QKV = 32 * 128 + 2 * 8 * 128
SHAPES = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTERMEDIATE),
          "down": (INTERMEDIATE, HIDDEN), "lm_head": (HIDDEN, VOCAB)}
ROTATION_BYTES = 512 << 20  # single-GEMM rows cycle through at least this many weight bytes (> L2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4", help="rows M per GEMM, comma-separated (1-8)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-step", action="store_true", help="skip the whole-step row (15 GB of weights)")
    parser.add_argument("--out", default=None, help="folder for bench_decode_mm_<date>.{md,json}")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if any(not 1 <= b <= 8 for b in args.batches):
        raise ValueError(f"--batches: every value must be in 1..8, got {args.batches}")
    return args


def frozen_weight(k: int, n: int) -> torch.Tensor:
    """A (k, n) column-major bf16 weight, as a frozen nn.Linear(k, n) reaches the GEMM."""
    return (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).t()


def max_error(product: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |product - a @ b| over the largest |a @ b| (float64 reference)."""
    reference = a.double() @ b.double()
    return ((product.double() - reference).abs().max() / reference.abs().max()).item()


def time_row(name, batch, calls, weight_bytes, bandwidth, repeats, whole=False):
    """Times the list of (a, b) products with both kernels; one result row: µs per product, or for all
    of them when ``whole`` (``weight_bytes`` counts the same)."""
    row = dict(row=name, batch=batch, gemms=len(calls), weight_mb=weight_bytes / 1e6)
    for label, mm in (("torch_mm", torch.mm), ("decode_mm", ops.decode_mm)):
        a, b = calls[0]
        row[f"{label}_error"] = max_error(mm(a, b), a, b)
        us = time_graph(lambda i: mm(*calls[i]), len(calls), repeats, 5) * (len(calls) if whole else 1)
        row[f"{label}_us"] = us
        row[f"{label}_gbps"] = weight_bytes / (us * 1e-6) / 1e9
        row[f"{label}_floor_pct"] = 100.0 * row[f"{label}_gbps"] * 1e9 / (bandwidth / 2)
    row["speedup"] = row["torch_mm_us"] / row["decode_mm_us"]
    return row


def run(args):
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()  # read + write bytes per second; a GEMM only reads, so half of it counts
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    rows = []
    for batch in args.batches:
        for name, (k, n) in SHAPES.items():
            copies = max(1, -(-ROTATION_BYTES // (2 * k * n)))
            weights = [frozen_weight(k, n) for _ in range(copies)]
            calls = [(torch.randn(batch, k, device="cuda", dtype=torch.bfloat16), w) for w in weights]
            rows.append(time_row(name, batch, calls, 2 * k * n, bandwidth, args.repeats))
            print(rows[-1], flush=True)
            del weights, calls
        if not args.no_step:
            calls = []
            for _ in range(LAYERS):
                for name in ("qkv", "o", "gate_up", "down"):
                    k, n = SHAPES[name]
                    calls.append((torch.randn(batch, k, device="cuda", dtype=torch.bfloat16), frozen_weight(k, n)))
            k, n = SHAPES["lm_head"]
            calls.append((torch.randn(batch, k, device="cuda", dtype=torch.bfloat16), frozen_weight(k, n)))
            step_bytes = sum(2 * b.numel() for _, b in calls)
            row = time_row("step", batch, calls, step_bytes, bandwidth, max(5, args.repeats // 3), whole=True)
            print(row, flush=True)
            rows.append(row)
            del calls
        torch.cuda.empty_cache()
    return bandwidth, rows


def markdown(rows, meta) -> str:
    lines = ["# Decode-step weight GEMMs: torch.mm (cuBLAS) against decode_mm", "",
             f"- date: {meta['date']}; GPU: {meta['gpu']}; torch {meta['torch']}, CUDA {meta['cuda']}",
             f"- command: `{meta['command']}`; code: {provenance.label(meta['code'])}",
             f"- copy bandwidth (read + write) in this run: {meta['copy_bandwidth_gbps']:.0f} GB/s; a GEMM reads its weight "
             "once, so % of floor is against half of it", "",
             "| B | GEMM | weight MB | torch.mm µs | GB/s | % floor | decode_mm µs | GB/s | % floor | speedup | max rel. error (mm / ours) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        label = r["row"] if r["row"] != "step" else f"step ({r['gemms']} GEMMs)"
        lines.append(f"| {r['batch']} | {label} | {r['weight_mb']:.0f} | {r['torch_mm_us']:.1f} | {r['torch_mm_gbps']:.0f} | "
                     f"{r['torch_mm_floor_pct']:.0f} | {r['decode_mm_us']:.1f} | {r['decode_mm_gbps']:.0f} | "
                     f"{r['decode_mm_floor_pct']:.0f} | {r['speedup']:.3f}x | {r['torch_mm_error']:.1e} / {r['decode_mm_error']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_mm.py needs a CUDA GPU")
    bandwidth, rows = run(args)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), command="python " + " ".join(sys.argv),
                code=provenance.describe(), copy_bandwidth_gbps=bandwidth / 1e9)
    text = markdown(rows, meta)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
        with open(os.path.join(args.out, f"bench_decode_mm_{stamp}.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, f"bench_decode_mm_{stamp}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
