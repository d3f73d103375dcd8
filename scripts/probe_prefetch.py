"""Encoder + selection per layer, with and without the encoder's L2 prefetch of the signature cache.

A decode step runs per layer: encode_signatures_pair_into (the new query and key signatures, the
key's written into the cache), then hamming_topk over every cached key signature. The encoder
launch also prefetches the cache rows into L2 (csrc/cuda/signature_prefetch.cuh) while DRAM is
otherwise idle; this script measures what that buys, per prefetch budget
(HASHATTENTION_SIGNATURE_PREFETCH_BYTES, read when each graph is captured):

    python scripts/probe_prefetch.py                               # B = 1 and 4, 128K, 32x
    python scripts/probe_prefetch.py --batches 4 --budgets-mib 0 16 24 32 --evict-last

Each step is: a copy of --flush-mib MiB (what the model's weight GEMMs do to L2 between two
layers' selections), the encoder (the paper's 128 -> 128 -> 128 -> 32 bf16 MLPs, 32 query heads,
per-query-head key signatures from 8 KV heads), the selection (sink = local = 128, a static cache
of n + 128 slots, lengths / starts / budgets as device tensors, as in the model). Graph replays
over --layers layers' buffers; µs per layer are medians, with the copy's own time subtracted.
Before timing, each budget's selection output is checked equal to the no-prefetch output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hashattention as ha  # noqa: E402
from bench_decode import time_graph  # noqa: E402

QUERY_HEADS, KV_HEADS, HEAD_DIM, SINK, LOCAL = 32, 8, 128, 128, 128
SIZES = (128, 128, 128, 32)
BUDGET = "HASHATTENTION_SIGNATURE_PREFETCH_BYTES"
EVICT_LAST = "HASHATTENTION_SIGNATURE_PREFETCH_EVICT_LAST"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--n", type=int, default=131072, help="cached keys per sequence")
    parser.add_argument("--sparsity", type=int, default=32)
    parser.add_argument("--budgets-mib", type=float, nargs="+", default=[0, 8, 16, 24, 32, 40],
                        help="prefetch budgets to time (0: off); the default budget is timed too")
    parser.add_argument("--evict-last", action="store_true", help="also time each budget with evict-last lines")
    parser.add_argument("--flush-mib", type=float, default=256.0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None, help="also write the rows here")
    return parser.parse_args()


def mlp(generator):
    weights = [torch.randn(QUERY_HEADS, i, o, generator=generator, device="cuda").mul(i**-0.5).to(torch.bfloat16)
               for i, o in zip(SIZES[:-1], SIZES[1:])]
    biases = [torch.randn(QUERY_HEADS, o, generator=generator, device="cuda").mul(0.1).to(torch.bfloat16)
              for o in SIZES[1:]]
    return weights, biases


def layer_buffers(batch: int, n: int, generator):
    slots = n + 128
    return dict(
        query=torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, generator=generator, device="cuda", dtype=torch.bfloat16),
        key=torch.randn(batch, KV_HEADS, 1, HEAD_DIM, generator=generator, device="cuda", dtype=torch.bfloat16),
        query_mlp=mlp(generator), key_mlp=mlp(generator),
        cache=torch.randint(-2**31, 2**31 - 1, (batch, QUERY_HEADS, slots, 1), generator=generator, device="cuda",
                            dtype=torch.int32),
    )


def main() -> int:
    args = parse_args()
    if not (torch.cuda.is_available() and ha.WITH_CUDA):
        sys.exit("probe_prefetch.py needs a GPU and the extension built with its CUDA kernels")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, L2 {l2 / 2**20:.0f} MiB; "
          f"n = {args.n}, {args.sparsity}x, flush {args.flush_mib:.0f} MiB per step, {args.layers} layers' buffers")
    g = torch.Generator(device="cuda").manual_seed(0)
    flush_src = torch.empty(int(args.flush_mib * 2**20) // 2, device="cuda", dtype=torch.bfloat16).normal_()
    flush_dst = torch.empty_like(flush_src)
    budgets = sorted({int(m * 2**20) for m in args.budgets_mib} | {l2 // 2})
    variants = [(b, False) for b in budgets] + ([(b, True) for b in budgets if b > 0] if args.evict_last else [])
    rows = []
    print("| B | budget MiB | evict-last | encode µs | select µs | encode + select µs | saved vs off µs |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batches:
        layers = [layer_buffers(batch, args.n, g) for _ in range(args.layers)]
        positions = torch.tensor([args.n - 1], device="cuda", dtype=torch.int64)  # the new key's slot
        lengths = torch.full((batch,), args.n, device="cuda", dtype=torch.int32)
        starts = torch.zeros(batch, device="cuda", dtype=torch.int32)
        slots = args.n + 128
        budget_tokens = max(slots // args.sparsity - SINK - LOCAL, 0)
        budgets_t = torch.full((batch,), max(args.n // args.sparsity - SINK - LOCAL, 0), device="cuda",
                               dtype=torch.int32)

        def flush(i):
            flush_dst.copy_(flush_src)

        def encode(i):
            flush(i)
            b = layers[i]
            return ha.encode_signatures_pair_into(b["query"], *b["query_mlp"], b["key"], *b["key_mlp"], b["cache"],
                                                  positions, "silu")

        def select(i):
            q = encode(i)
            return ha.hamming_topk(q, layers[i]["cache"], selection_heads=QUERY_HEADS, sink_tokens=SINK,
                                   local_tokens=LOCAL, budget_tokens=budget_tokens, lengths=lengths,
                                   start_positions=starts, budgets=budgets_t)

        flush_us = time_graph(flush, args.layers, args.repeats, 5)
        reference = None
        off = None
        for budget, evict_last in variants:
            os.environ[BUDGET] = str(budget)
            os.environ[EVICT_LAST] = "1" if evict_last else "0"
            out = select(0)
            torch.cuda.synchronize()
            if reference is None:
                reference = [t.clone() for t in out]
            elif not all(torch.equal(a, b) for a, b in zip(out, reference)):
                raise SystemExit(f"B={batch} budget {budget}: the selection differs from the first variant's")
            encode_us = time_graph(encode, args.layers, args.repeats, 5) - flush_us
            both_us = time_graph(select, args.layers, args.repeats, 5) - flush_us
            if budget == 0 and not evict_last:
                off = both_us
            row = dict(batch=batch, n=args.n, budget_bytes=budget, evict_last=evict_last, encode_us=encode_us,
                       select_us=both_us - encode_us, encode_select_us=both_us,
                       saved_us=None if off is None else off - both_us, flush_us=flush_us,
                       signature_bytes=batch * QUERY_HEADS * args.n * 4, l2_bytes=l2)
            rows.append(row)
            saved = "-" if row["saved_us"] is None else f"{row['saved_us']:.2f}"
            print(f"| {batch} | {budget / 2**20:.0f}{' (default)' if budget == l2 // 2 else ''} | "
                  f"{'yes' if evict_last else 'no'} | {encode_us:.2f} | {both_us - encode_us:.2f} | {both_us:.2f} | {saved} |",
                  flush=True)
        os.environ.pop(BUDGET, None)
        os.environ.pop(EVICT_LAST, None)
        del layers
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
