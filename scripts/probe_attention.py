"""Where the sparse attention kernel's time goes, and how its launch shape changes it (GPU only).

Times graph replays of `hashattention.sparse_attention` on indices selected beforehand (random
signatures, as scripts/bench_decode.py), for each launch shape given by the timing aids of
csrc/cuda/sparse_attention.cu, and for each stopping point of the kernel
(HASHATTENTION_ATTENTION_PROBE: 1 = after the prologue, 2 = after the main loop):

    python scripts/probe_attention.py                                  # B = 1 and 4, 32x
    python scripts/probe_attention.py --batches 1 --ns 131072 --shapes default 8:32

A shape is BLOCKS_PER_SM:MIN_ROWS_PER_SPLIT, or "default" (the op's own choice), optionally followed
by "/c" and the largest cluster of splits (HASHATTENTION_ATTENTION_CLUSTER; "/c0": the counters'
merge, never a cluster):

    python scripts/probe_attention.py --batches 1 --ns 32768 131072 --shapes default default/c0

Each shape's output is compared with the first shape's, so a launch shape that changes the result
is reported. Inputs rotate over layer buffers so that K/V come from DRAM: by default as many as
bench_decode.probe_buffers gives (each reused only after two L2s of other steps' bytes, within
--memory-gib), or --layers; each replay passes over them as often as makes at least 32 steps
(bench_decode.time_steps).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hashattention as ha  # noqa: E402
from bench_decode import probe_buffers, time_steps  # noqa: E402

QUERY_HEADS, KV_HEADS, HEAD_DIM, SINK, LOCAL = 32, 8, 128, 128, 128
KNOBS = ("HASHATTENTION_ATTENTION_BLOCKS_PER_SM", "HASHATTENTION_ATTENTION_MIN_ROWS")
CLUSTER = "HASHATTENTION_ATTENTION_CLUSTER"
PROBE = "HASHATTENTION_ATTENTION_PROBE"


def shape_environment(shape: str) -> dict[str, str]:
    """The timing aids that select a launch shape: "default" or "BLOCKS_PER_SM:MIN_ROWS", then
    optionally "/cN" (the largest cluster), e.g. "4:128/c0"."""
    split_shape, *options = shape.split("/")
    environment = {}
    if split_shape != "default":
        values = split_shape.split(":")
        if len(values) != 2 or not all(v.isdigit() for v in values):
            raise ValueError(f"shape {shape!r}: expected 'default' or BLOCKS_PER_SM:MIN_ROWS before any '/'")
        environment.update(zip(KNOBS, values))
    for option in options:
        if option[:1] != "c" or not option[1:].isdigit() or CLUSTER in environment:
            raise ValueError(f"shape {shape!r}: expected at most one option '/cN', got {option!r}")
        environment[CLUSTER] = option[1:]
    return environment


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ns", type=int, nargs="+", default=[32768, 131072, 524288])
    parser.add_argument("--sparsity", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["head", "group"], choices=("head", "group"))
    parser.add_argument("--shapes", nargs="+", default=["default", "4:128", "8:32"])
    parser.add_argument("--layers", type=int, default=None,
                        help="layer buffers rotated per replay (default: enough that a step's bytes have left L2)")
    parser.add_argument("--memory-gib", type=float, default=40.0, help="cap on the default buffers' K/V bytes")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--max-positions", type=int, default=4 * 131072, help="skip B x n above this")
    args = parser.parse_args()
    for shape in args.shapes:
        try:
            shape_environment(shape)
        except ValueError as error:
            parser.error(str(error))
    return args


def budget_tokens(n, sparsity):
    """Heavy tokens per list beyond the sink and local windows: n / sparsity attended in all."""
    return max(n // sparsity - SINK - LOCAL, 0)


def make_layers(batch, n, mode, sparsity, layers, generator):
    heads = QUERY_HEADS if mode == "head" else KV_HEADS
    budget = budget_tokens(n, sparsity)
    out = []
    for _ in range(layers):
        q = torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        k = torch.randn(batch, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        v = torch.randn(batch, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        q_sig = torch.randint(-2**31, 2**31 - 1, (batch, QUERY_HEADS, 1, 1), device="cuda", dtype=torch.int32,
                              generator=generator)
        k_sig = torch.randint(-2**31, 2**31 - 1, (batch, heads, n, 1), device="cuda", dtype=torch.int32,
                              generator=generator)
        indices, counts = ha.hamming_topk(q_sig, k_sig, selection_heads=heads, sink_tokens=SINK, local_tokens=LOCAL,
                                          budget_tokens=budget)
        del k_sig
        out.append((q, k, v, indices, counts))
    return out


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() or not ha.WITH_CUDA:
        print("probe_attention.py needs a CUDA build and a GPU", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.sparsity}x, sink {SINK}, local {LOCAL}")
    print(f"{'B':>2} {'n':>7} {'mode':>5} {'shape':>9} {'full us':>8} {'prologue':>8} {'loop':>8} {'merge':>8} "
          f"{'GB/s':>7} {'max diff':>9} {'buffers':>7}")
    scale = HEAD_DIM**-0.5
    for batch in args.batches:
        for n in args.ns:
            if batch * n > args.max_positions:
                continue
            for mode in args.modes:
                g = torch.Generator(device="cuda").manual_seed(batch * n)
                rows = QUERY_HEADS if mode == "head" else KV_HEADS
                width = SINK + LOCAL + budget_tokens(n, args.sparsity)  # the index lists' width
                nbytes = batch * rows * width * HEAD_DIM * 2 * 2  # K and V of every listed row
                buffers = probe_buffers(args.layers, 2 * batch * KV_HEADS * n * HEAD_DIM * 2, nbytes,
                                        torch.cuda.get_device_properties(0).L2_cache_size,
                                        int(args.memory_gib * 2**30))
                layers = make_layers(batch, n, mode, args.sparsity, buffers, g)

                def step(i):
                    q, k, v, indices, counts = layers[i]
                    return ha.sparse_attention(q, k, v, indices, counts, scale=scale)

                reference = None
                for shape in args.shapes:
                    for name in KNOBS + (CLUSTER,):
                        os.environ.pop(name, None)
                    os.environ.update(shape_environment(shape))
                    out = step(0)[0].float()
                    if reference is None:
                        reference = out
                    diff = float((out - reference).abs().max())
                    times = {}
                    for stop in ("1", "2", "0"):
                        os.environ[PROBE] = stop
                        times[stop] = time_steps(step, buffers, args.repeats, 5)
                    os.environ.pop(PROBE, None)
                    print(f"{batch:2d} {n:7d} {mode:>5} {shape:>9} {times['0']:8.1f} {times['1']:8.1f} "
                          f"{times['2'] - times['1']:8.1f} {times['0'] - times['2']:8.1f} "
                          f"{nbytes / times['0'] / 1e3:7.0f} {diff:9.2e} {buffers:7d}", flush=True)
                for name in KNOBS + (CLUSTER,):
                    os.environ.pop(name, None)
                del layers
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
