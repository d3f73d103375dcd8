"""Phase times of the one-launch selection kernel (hamming_topk_resident.cu), on the GPU.

The kernel runs in three phases: scoring (read every key signature, distances to shared memory,
chunk histograms), a grid-wide barrier, then threshold and compaction. Nsight Compute gives stall
samples but no timeline, so this script times graph replays of `hashattention.hamming_topk` once
per stopping point (HASHATTENTION_SELECTION_PROBE = scoring, barrier, threshold, counts: the
kernel returns after phase 1, the grid barrier, the threshold, the warps' entry counts) and once
in full, and prints the time of each phase as the differences:

    python scripts/probe_selection.py                       # B = 1 and 4, 32K / 128K / 512K, 32x
    python scripts/probe_selection.py --batches 4 --ns 131072 --selection kv_group
    python scripts/probe_selection.py --batches 4 --ns 131072 --per-sequence --signatures mlp  # as in a model
    python scripts/probe_selection.py --batches 1 --ns 8192 32768 131072 --read-floor
    python scripts/probe_selection.py --batches 1 4 --ns 131072 --variants --timeline

--variants also times three whole-kernel variants: "nostores" (phase 2 runs but its position
stores are predicated off) and "nosplit" (the boundary chunk of each row takes the uniform write
path), whose output is wrong, and "twopass" (correct output: phase 2 counts and writes in two
passes over the distance bytes, the path of 64K-position blocks, instead of from registers). --timeline runs one eager launch whose blocks record their
multiprocessor, start and end (%globaltimer) and the clock64 cycles of each phase, and prints
the spread of every phase over the blocks, boundary and other blocks apart.

--read-floor adds what any one-kernel selection costs at the least, measured in the same way (graph
replays of one launch per step, as bench_decode.py times them): "empty", a kernel that writes one word (the launch and
the gap between two kernels of a graph), and "read", the best of a few Triton kernels that read
the same key-signature bytes once and write one word per block (no scoring, no second phase).

The probed runs leave the output unwritten: timing only. Inputs rotate over layer buffers so
that the signatures come from DRAM: by default as many as bench_decode.probe_buffers gives (each
reused only after two L2s of other steps' bytes), or --layers. Shapes as in scripts/bench_decode.py
(32 query heads, 8 KV heads, sink = local = 128); each replay passes over the buffers as often as
makes at least 32 steps (bench_decode.time_steps). GB/s counts the key-signature bytes one step must read.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hashattention as ha  # noqa: E402
from bench_decode import probe_buffers, time_steps  # noqa: E402
import read_floor as floors  # noqa: E402


QUERY_HEADS, KV_HEADS, SINK, LOCAL = 32, 8, 128, 128
PROBE = "HASHATTENTION_SELECTION_PROBE"
TIMELINE = "HASHATTENTION_SELECTION_TIMELINE"
TIMELINE_WORDS = 8  # kTimelineWords in hamming_topk_resident.cu


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ns", type=int, nargs="+", default=[32768, 131072, 524288])
    parser.add_argument("--sparsity", type=int, default=32)
    parser.add_argument("--selection", default="query_head", choices=("query_head", "kv_group"))
    parser.add_argument("--layers", type=int, default=None,
                        help="input buffers rotated per replay (default: enough that a step's bytes have left L2)")
    parser.add_argument("--memory-gib", type=float, default=40.0, help="cap on the default buffers' bytes")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--per-sequence", action="store_true",
                        help="pass lengths, start_positions and budgets as device tensors, as a patched model does "
                             "(a static cache with 128 spare slots past the n valid keys)")
    parser.add_argument("--signatures", default="uniform", choices=("uniform", "mlp"),
                        help="uniform random words, or the signs of a random 128 -> 128 -> 32 MLP of Gaussian "
                             "vectors (random adapters on random keys, as the end-to-end benchmark's)")
    parser.add_argument("--read-floor", action="store_true",
                        help="also time an empty kernel and a plain read of the same signature bytes (needs Triton)")
    parser.add_argument("--variants", action="store_true",
                        help="also time the nostores and nosplit kernel variants (wrong output, timing only) "
                             "and the twopass one (correct output)")
    parser.add_argument("--timeline", action="store_true",
                        help="also record one launch's per-block phase timeline and print its spread")
    parser.add_argument("--timeline-out", default="", help="folder for the raw per-block timelines (CSV)")
    return parser.parse_args()


def random_signatures(shape, generator, kind: str) -> torch.Tensor:
    """int32 signatures of `shape` (..., 1): uniform words, or a random MLP's signs of Gaussian rows."""
    if kind == "uniform":
        return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, device="cuda", dtype=torch.int32)
    batch, heads, rows, _ = shape
    sizes = (128, 128, 32)
    weights = [torch.randn(heads, i, o, generator=generator, device="cuda").mul(i**-0.5) for i, o in zip(sizes, sizes[1:])]
    biases = [torch.randn(heads, o, generator=generator, device="cuda").mul(0.1) for o in sizes[1:]]
    out = torch.empty(shape, device="cuda", dtype=torch.int32)
    for start in range(0, rows, 16384):
        x = torch.randn(batch, heads, min(16384, rows - start), 128, generator=generator, device="cuda")
        out[:, :, start:start + x.shape[2]] = ha.encode_signatures(x, weights, biases, "silu")
    return out


def key_signature_shape(batch: int, n: int, args) -> tuple[int, int, int, int]:
    """(batch, key heads, slots, 1) of one layer's key signatures: one head per query head or per KV
    head (--selection), and 128 spare slots past n with --per-sequence (a cache with room to grow)."""
    key_heads = QUERY_HEADS if args.selection == "query_head" else KV_HEADS
    slots = n + 128 if args.per_sequence else n
    return batch, key_heads, slots, 1


def signature_buffers(batch: int, n: int, args) -> int:
    """How many layers' key signatures to rotate over (--layers, else bench_decode.probe_buffers)."""
    per_layer = math.prod(key_signature_shape(batch, n, args)) * 4
    return probe_buffers(args.layers, per_layer, per_layer, torch.cuda.get_device_properties(0).L2_cache_size,
                         int(args.memory_gib * 2**30))


def selection_steps(batch: int, n: int, args):
    """`step(i)` running hamming_topk on layer buffer i < buffers, as in a model; the key-signature
    bytes a step reads; the number of buffers."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = key_signature_shape(batch, n, args)
    selection_heads, slots = shape[1], shape[2]
    layers = []
    buffers = signature_buffers(batch, n, args)
    for _ in range(buffers):
        q = random_signatures((batch, QUERY_HEADS, 1, 1), g, args.signatures)
        k = random_signatures(shape, g, args.signatures)
        layers.append((q, k))
    budget = max(n // args.sparsity - SINK - LOCAL, 0)
    per_sequence = {}
    if args.per_sequence:
        per_sequence = dict(lengths=torch.full((batch,), n, device="cuda", dtype=torch.int32),
                            start_positions=torch.zeros(batch, device="cuda", dtype=torch.int32),
                            budgets=torch.full((batch,), budget, device="cuda", dtype=torch.int32))
        budget = max(slots // args.sparsity - SINK - LOCAL, 0)  # the static width, as heavy_width gives

    def step(i):
        q, k = layers[i]
        return ha.hamming_topk(q, k, selection_heads=selection_heads, sink_tokens=SINK, local_tokens=LOCAL,
                               budget_tokens=budget, **per_sequence)

    return step, batch * selection_heads * n * 4, buffers


def time_selection(batch: int, n: int, args) -> tuple[float, int]:
    """Median µs of one hamming_topk call, and the key-signature bytes it reads."""
    step, nbytes, buffers = selection_steps(batch, n, args)
    return time_steps(step, buffers, args.repeats, 5), nbytes


def percentiles(values: torch.Tensor) -> str:
    """min / median / p90 / max of a float tensor, as text."""
    if values.numel() == 0:
        return "-"
    q = torch.quantile(values, torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=values.dtype))
    return " / ".join(f"{v:.2f}" for v in q.tolist())


def print_timeline(batch: int, n: int, args) -> None:
    """One eager launch with per-block timelines (see BlockTimeline in hamming_topk_resident.cu)."""
    step, _, buffers = selection_steps(batch, n, args)
    for i in range(buffers):  # warm-up; the timed call's buffer (0) is out of L2 afterwards
        step(i)
    record = torch.zeros(1 << 20, TIMELINE_WORDS, device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    os.environ[TIMELINE] = str(record.data_ptr())
    try:
        step(0)
        torch.cuda.synchronize()
    finally:
        os.environ.pop(TIMELINE, None)
    r = record.cpu().to(torch.int64)
    r = r[r[:, 6] != 0]
    if r.numel() == 0:
        print("  timeline: no block recorded (not the one-launch kernel?)")
        return
    sm, split, chunk = r[:, 0] & 0xFFFF, (r[:, 0] >> 16) & 1, r[:, 0] >> 17
    start = (r[:, 1] - r[0, 1] + 2**31) % 2**32 - 2**31  # wrapping ns differences
    end = (r[:, 7] - r[0, 1] + 2**31) % 2**32 - 2**31
    origin = start.min()
    start, end = (start - origin).double() / 1e3, (end - origin).double() / 1e3  # µs from the first start
    cycles = r[:, 2:7].double()
    us_per_cycle = ((end - start) / cycles[:, 4]).median().item()
    phases = torch.cat([cycles[:, :1], cycles[:, 1:] - cycles[:, :-1]], dim=1) * us_per_cycle
    per_sm = torch.bincount(sm)
    print(f"  timeline B={batch} n={n}: {r.shape[0]} blocks on {int((per_sm > 0).sum())} multiprocessors "
          f"({int(per_sm[per_sm > 0].min())}-{int(per_sm.max())} each), span {end.max().item():.2f} µs, "
          f"clock {1 / us_per_cycle:.0f} MHz; min / median / p90 / max µs:")
    print(f"    {'blocks':<16} {'count':>5}  {'start':>22}  {'phase 1':>22}  {'barrier':>22}  {'threshold':>22}  "
          f"{'counts':>22}  {'writes':>22}  {'end':>22}")
    groups = [("all", torch.ones_like(split, dtype=torch.bool)), ("boundary (split)", split == 1), ("other", split == 0)]
    groups += [(f"{k} blocks on its SM", per_sm[sm] == k) for k in range(1, int(per_sm.max()) + 1)]
    groups += [(f"chunk {c}", chunk == c) for c in range(int(chunk.max()) + 1)]
    for name, mask in groups:
        if int(mask.sum()) == 0:
            continue
        cells = [percentiles(start[mask])] + [percentiles(phases[mask, k]) for k in range(5)] + [percentiles(end[mask])]
        print(f"    {name:<16} {int(mask.sum()):5d}  " + "  ".join(f"{c:>22}" for c in cells))
    if args.timeline_out:
        path = os.path.join(args.timeline_out, f"timeline_B{batch}_n{n}{'_seq' if args.per_sequence else ''}.csv")
        with open(path, "w") as f:
            f.write("sm,split,chunk,start_us,end_us,phase1_us,barrier_us,threshold_us,counts_us,writes_us\n")
            for i in range(r.shape[0]):
                f.write(f"{int(sm[i])},{int(split[i])},{int(chunk[i])},{start[i].item():.3f},{end[i].item():.3f}," +
                        ",".join(f"{phases[i, k].item():.3f}" for k in range(5)) + "\n")


def read_floor(batch: int, n: int, args) -> tuple[float, float]:
    """Median µs of an empty kernel and of the best plain read of the selection's signature bytes.

    Timed as time_selection times the selection (bench_decode.time_steps), so both numbers carry
    the same per-launch gaps (scripts/read_floor.py).
    """
    if not floors.available():
        raise SystemExit("--read-floor needs Triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    count = signature_buffers(batch, n, args)
    buffers = [[random_signatures(key_signature_shape(batch, n, args), g, "uniform").view(-1)] for _ in range(count)]
    empty = floors.time_empty(time_steps, count, args.repeats)
    best = floors.time_read(buffers, time_steps, args.repeats)
    del buffers
    return empty, best


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() or not ha.WITH_CUDA:
        print("probe_selection.py needs a CUDA build and a GPU", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, selection {args.selection}, "
          f"{args.sparsity}x, sink {SINK}, local {LOCAL}, signatures {args.signatures}, "
          f"per-sequence tensors {'yes' if args.per_sequence else 'no'}")
    floor_header = f" {'empty':>6} {'read':>6} {'GB/s rd':>8}" if args.read_floor else ""
    print(f"{'B':>2} {'n':>7} {'full us':>8} {'scoring':>8} {'barrier':>8} {'thresh.':>8} {'counts':>8} "
          f"{'writes':>8} {'GB/s':>7} {'GB/s p1':>8}" + floor_header)
    modes = ("", "counts", "threshold", "barrier", "scoring")
    variants = ("nostores", "nosplit", "twopass") if args.variants else ()
    for batch in args.batches:
        for n in args.ns:
            times = {}
            for mode in modes:
                os.environ[PROBE] = mode
                times[mode], nbytes = time_selection(batch, n, args)
            for mode in variants:
                os.environ[PROBE] = mode
                times[mode], _ = time_selection(batch, n, args)
            os.environ.pop(PROBE, None)
            cumulative = [times[mode] for mode in reversed(modes)]  # scoring, barrier, ..., full
            deltas = [cumulative[0]] + [b - a for a, b in zip(cumulative, cumulative[1:])]
            floor = ""
            if args.read_floor:
                empty, read = read_floor(batch, n, args)
                floor = f" {empty:6.1f} {read:6.1f} {nbytes / read / 1e3:8.0f}"
            print(f"{batch:2d} {n:7d} {times['']:8.1f} " + " ".join(f"{d:8.1f}" for d in deltas) +
                  f" {nbytes / times[''] / 1e3:7.0f} {nbytes / times['scoring'] / 1e3:8.0f}" + floor)
            if variants:
                print("   variants (full µs): " + ", ".join(f"{mode} {times[mode]:.1f}" for mode in variants))
            if args.timeline:
                print_timeline(batch, n, args)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
