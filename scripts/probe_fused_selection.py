"""Where a decode step's encode + select time goes, one- and two-launch (encode_pair_and_select), on the GPU.

A decode step's selection needs the query signatures first. `encode_pair_and_select` runs the encoder
(query rows and the new key, `encode_signatures_pair_into`) and then `hamming_topk`, two launches; with
HASHATTENTION_FUSED_SELECTION=1 the one-launch selection kernel computes the signatures itself
(csrc/cuda/query_mlp_prologue.cuh: in a phase 0 before a grid barrier, chunk 0's block of each row runs
the query MLP and chunk 1's block the new key's). This script times graph replays of one
call per layer buffer (rotated over --layers buffers, so that signatures and MLP weights come from DRAM,
as in a model), for:

    encoder        encode_signatures_pair_into alone
    select         hamming_topk alone (query signatures given)
    two_launch     encode_pair_and_select, HASHATTENTION_FUSED_SELECTION=0
    fused          encode_pair_and_select, HASHATTENTION_FUSED_SELECTION=1
    select@mlp     hamming_topk stopped where phase 0 would end (HASHATTENTION_SELECTION_PROBE=mlp): launch,
                   window reads and first loads
    fused@mlp      the fused kernel stopped after phase 0: the same plus both MLPs and the grid barrier
    select@scoring / fused@scoring   both stopped after phase 1

and prints each one's median µs, so that phase 0 (fused@mlp - select@mlp) and what else the fused kernel
adds up to the end of phase 1 (fused@scoring - select@scoring - phase 0: the new key's distance redone,
register pressure) show apart. The probed runs leave outputs unwritten (timing only).

    python scripts/probe_fused_selection.py                      # B = 1 and 2 (4 where memory allows), 128K
    python scripts/probe_fused_selection.py --batches 4 --ns 32768 131072
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

QUERY_HEADS, KV_HEADS, D, SINK, LOCAL, SPARE_SLOTS = 32, 8, 128, 128, 128, 131
FUSED, PROBE = "HASHATTENTION_FUSED_SELECTION", "HASHATTENTION_SELECTION_PROBE"
# (name, op, FUSED, PROBE): op "encoder", "select" or "pair" (encode_pair_and_select).
VARIANTS = [
    ("encoder", "encoder", "0", ""),
    ("select", "select", "0", ""),
    ("two_launch", "pair", "0", ""),
    ("fused", "pair", "1", ""),
    ("select@mlp", "select", "0", "mlp"),
    ("fused@mlp", "pair", "1", "mlp"),
    ("select@scoring", "select", "0", "scoring"),
    ("fused@scoring", "pair", "1", "scoring"),
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="default: 1 and 2, and 4 on a GPU with more than 100 GB")
    parser.add_argument("--ns", type=int, nargs="+", default=[131072])
    parser.add_argument("--sparsity", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8, help="input buffers rotated per replay")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default="", help="also write the results here")
    return parser.parse_args()


def mlp(g: torch.Generator):
    widths = (128, 128, 128, 32)
    weights = [(torch.randn(QUERY_HEADS, i, o, generator=g, device="cuda") / i**0.5).bfloat16()
               for i, o in zip(widths[:-1], widths[1:])]
    biases = [(0.1 * torch.randn(QUERY_HEADS, o, generator=g, device="cuda")).bfloat16() for o in widths[1:]]
    return weights, biases


def layer_inputs(batch: int, n: int, layers: int):
    """Per layer: the query and new key rows, both MLPs, a static key-signature cache of n + spare slots
    (the new key goes to slot n), and the query signatures for the select-only variant."""
    g = torch.Generator(device="cuda").manual_seed(batch * 31 + n)
    slots = n + SPARE_SLOTS
    out = []
    for _ in range(layers):
        out.append(dict(
            query=torch.randn(batch, QUERY_HEADS, 1, D, generator=g, device="cuda").bfloat16(),
            key=torch.randn(batch, KV_HEADS, 1, D, generator=g, device="cuda").bfloat16(),
            query_mlp=mlp(g), key_mlp=mlp(g),
            key_signatures=torch.randint(-2**31, 2**31 - 1, (batch, QUERY_HEADS, slots, 1), generator=g,
                                         device="cuda", dtype=torch.int32),
            query_signatures=torch.randint(-2**31, 2**31 - 1, (batch, QUERY_HEADS, 1, 1), generator=g,
                                           device="cuda", dtype=torch.int32)))
    return out


def time_variant(op: str, inputs, batch: int, n: int, args) -> float:
    lengths = torch.full((batch,), n + 1, device="cuda", dtype=torch.int32)
    starts = torch.zeros(batch, device="cuda", dtype=torch.int32)
    budget = max((n + 1) // args.sparsity - SINK - LOCAL, 0)
    budgets = torch.full((batch,), budget, device="cuda", dtype=torch.int32)
    positions = torch.tensor([n], device="cuda")
    width = max((n + SPARE_SLOTS) // args.sparsity - SINK - LOCAL, 0)  # the static width, as a model's
    selection = dict(selection_heads=QUERY_HEADS, sink_tokens=SINK, local_tokens=LOCAL, budget_tokens=width,
                     lengths=lengths, start_positions=starts, budgets=budgets)

    def step(i):
        x = inputs[i]
        if op == "encoder":
            return ha.encode_signatures_pair_into(x["query"], *x["query_mlp"], x["key"], *x["key_mlp"],
                                                  x["key_signatures"], positions, "silu")
        if op == "select":
            return ha.hamming_topk(x["query_signatures"], x["key_signatures"], **selection)
        return ha.encode_pair_and_select(x["query"], *x["query_mlp"], x["key"], *x["key_mlp"], x["key_signatures"],
                                         positions, activation="silu", **selection)

    return time_graph(step, args.layers, args.repeats, 5)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_fused_selection.py needs a CUDA GPU")
    batches = args.batches
    if batches is None:
        big = torch.cuda.get_device_properties(0).total_memory > 100e9
        batches = [1, 2, 4] if big else [1, 2]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.layers} layer buffers, "
          f"{args.sparsity}x, per query head, static cache of n + {SPARE_SLOTS} slots")
    saved = {name: os.environ.get(name) for name in (FUSED, PROBE)}
    results = []
    try:
        for n in args.ns:
            for batch in batches:
                inputs = layer_inputs(batch, n, args.layers)
                row = {"batch": batch, "n": n}
                for name, op, fused, probe in VARIANTS:
                    os.environ[FUSED] = fused
                    os.environ[PROBE] = probe
                    row[name] = time_variant(op, inputs, batch, n, args)
                os.environ[PROBE] = ""
                row["phase0_us"] = row["fused@mlp"] - row["select@mlp"]
                row["phase1_extra_us"] = row["fused@scoring"] - row["select@scoring"] - row["phase0_us"]
                results.append(row)
                print(f"B={batch} n={n}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                        if k not in ("batch", "n")), flush=True)
                del inputs
                torch.cuda.empty_cache()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    names = [v[0] for v in VARIANTS] + ["phase0_us", "phase1_extra_us"]
    print("\n| B | n | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for row in results:
        print(f"| {row['batch']} | {row['n']} | " + " | ".join(f"{row[k]:.2f}" for k in names) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
