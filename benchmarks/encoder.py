"""Decode-step signature encoder on the GPU: µs per layer, as a model's decode step runs it.

A decode step of a patched model calls ``encode_signatures_pair`` once per layer: the new query
row of every query head and the new key row through the per-query-head key MLPs (Llama-3.1-8B
shape: 32 query heads, 8 KV heads, D = 128, bf16 weights, the paper's 128 -> 128 -> 128 -> 32
MLP: 72 KB per head and side). Inside a model the adapter weights are not in L2 (the model's
own weights stream through it between layers), so this script captures one CUDA graph of
``--launches`` (32) launches cycling over ``--layers`` layers' weights (``--layers 32``: 145 MiB,
about 2.5x the H200's L2) and reports the mean time per launch; ``--layers 1`` gives the L2-warm
time (a graph of a single launch would mostly time the graph launch itself).

Rows per configuration: ours (the fused kernel) and, as the baseline measured in the same run,
the same MLPs in plain PyTorch (one batched product per layer, bias, activation, then
``pack_signs``), both in CUDA graphs. Columns: µs per layer, GB/s over the bytes a launch must
read (weights, biases, inputs), the ratio to the baseline. The encoder kernel is the library's
automatic choice for the row count; ``HASHATTENTION_ENCODER`` forces one (``fma``, ``mma``,
``cluster2``, ``cluster4``), and the results file records it.

The results go to ``benchmarks/results/encoder_<gpu>.{md,json}``, replacing an earlier run's.

    python -m benchmarks.encoder                                  # B = 1, 4; 32 layers' weights
    python -m benchmarks.encoder --batches 1 4 8 --layers 1       # weights warm in L2
    python -m benchmarks.encoder --hidden 128 --out /tmp/enc      # 128 -> 128 -> 32
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import hashattention as ha
from benchmarks import common
from benchmarks.common import time_graph

BENCHMARK = "encoder"
QUERY_HEADS, KV_HEADS, HEAD_DIM, BITS = 32, 8, 128, 32


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.encoder", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--hidden", type=int, nargs="*", default=[128, 128],
                        help="hidden widths of the MLPs (default: the paper's 128 128)")
    parser.add_argument("--layers", type=int, default=32, help="layers' weights the graph rotates over")
    parser.add_argument("--launches", type=int, default=32, help="encoder launches per graph (one per layer in a model)")
    parser.add_argument("--repeats", type=int, default=50, help="graph replays timed (median)")
    parser.add_argument("--out", default=None, help="folder of encoder_<gpu>.{md,json} (default: benchmarks/results)")
    return parser.parse_args(argv)


def mlp_stack(heads: int, sizes, generator):
    """Random bf16 weights (heads, in, out) and biases (heads, out) of one MLP per head, for layer widths `sizes`."""
    weights = [torch.randn(heads, i, o, generator=generator, device="cuda").mul(i**-0.5).to(torch.bfloat16)
               for i, o in zip(sizes[:-1], sizes[1:])]
    biases = [torch.randn(heads, o, generator=generator, device="cuda").mul(0.1).to(torch.bfloat16)
              for o in sizes[1:]]
    return weights, biases


def torch_encode(x: torch.Tensor, weights, biases, heads: int) -> torch.Tensor:
    """The baseline: (B, Hx, 1, D) -> per-head MLP in plain PyTorch -> packed signs (B, H, 1, W)."""
    batch = x.shape[0]
    h = x.squeeze(2).repeat_interleave(heads // x.shape[1], dim=1).transpose(0, 1).float()  # (H, B, D)
    for index, (w, b) in enumerate(zip(weights, biases)):
        h = torch.baddbmm(b.float().unsqueeze(1), h, w.float())
        if index + 1 < len(weights):
            h = F.silu(h)
    return ha.pack_signs(h.transpose(0, 1).reshape(batch, heads, 1, -1))


def markdown(record: dict) -> str:
    meta = record["meta"]
    sizes = " -> ".join(str(size) for size in meta["mlp_sizes"])
    lines = [f"# Decode-step signature encoder ({meta['device']})", "", *common.header_lines(meta),
             f"- shape: {QUERY_HEADS} query / {KV_HEADS} KV heads, per-query-head key MLPs, D = {HEAD_DIM}, bf16, "
             f"MLP {sizes}; a CUDA graph of {meta['launches']} `encode_signatures_pair` launches over "
             f"{meta['layers']} layers' weights ({meta['weights_mib']:.1f} MiB)", "",
             "| B | method | µs per layer | GB/s | ratio to PyTorch | signature words equal to PyTorch's |",
             "|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['batch']} | {r['method']} | {r['us']:.2f} | {r['gbps']:.0f} | {r['ratio']:.2f}x | "
                     f"{100 * r['words_agreeing']:.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if not (torch.cuda.is_available() and ha.WITH_CUDA):
        raise SystemExit("benchmarks.encoder needs a GPU and the extension built with its CUDA kernels")
    sizes = (HEAD_DIM, *args.hidden, BITS)
    g = torch.Generator(device="cuda").manual_seed(0)
    stacks = [(mlp_stack(QUERY_HEADS, sizes, g), mlp_stack(QUERY_HEADS, sizes, g)) for _ in range(args.layers)]
    weight_bytes = 2 * sum(w.numel() * w.element_size() + b.numel() * b.element_size()
                           for w, b in zip(*stacks[0][0]))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; MLP {sizes}, "
          f"{QUERY_HEADS} query / {KV_HEADS} KV heads, bf16; {args.launches} launches per graph over "
          f"{args.layers} layers' weights ({args.layers * weight_bytes / 2**20:.1f} MiB)")
    rows = []
    print("| B | method | µs per layer | GB/s | ratio to PyTorch |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        query = torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
        key = torch.randn(batch, KV_HEADS, 1, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
        # Correctness first: the fused kernel against the baseline (bits within rounding of 0 may differ).
        (qw, qb), (kw, kb) = stacks[0]
        fused_q, fused_k = ha.encode_signatures_pair(query, qw, qb, key, kw, kb, "silu")
        agree = (torch.cat([fused_q, fused_k]) == torch.cat([torch_encode(query, qw, qb, QUERY_HEADS),
                                                            torch_encode(key, kw, kb, QUERY_HEADS)])).float().mean()
        bytes_per_launch = weight_bytes + (query.numel() + key.numel()) * 2
        schedule = [stacks[i % args.layers] for i in range(args.launches)]
        # time_graph replays one graph of step(0) ... step(launches - 1) and returns µs per step.
        ours = time_graph(lambda i: ha.encode_signatures_pair(query, *schedule[i][0], key, *schedule[i][1], "silu"),
                          args.launches, args.repeats, 5)
        baseline = time_graph(lambda i: (torch_encode(query, *schedule[i][0], QUERY_HEADS),
                                         torch_encode(key, *schedule[i][1], QUERY_HEADS)),
                              args.launches, args.repeats, 5)
        for method, us in (("pytorch (bmm chain + pack_signs)", baseline), ("ours (encode_signatures_pair)", ours)):
            row = dict(batch=batch, method=method, us=us, gbps=bytes_per_launch / us / 1e3, ratio=baseline / us,
                       words_agreeing=float(agree))
            rows.append(row)
            print(f"| {batch} | {method} | {us:.2f} | {row['gbps']:.0f} | {row['ratio']:.2f}x |")
        print(f"  (B={batch}: {100 * float(agree):.2f}% of signature words equal the PyTorch baseline's)")
    meta = common.run_metadata(common.command_line(f"benchmarks.{BENCHMARK}", argv))
    meta.update(mlp_sizes=list(sizes), layers=args.layers, launches=args.launches,
                weights_mib=args.layers * weight_bytes / 2**20)
    record = dict(meta=meta, rows=rows)
    md_path, json_path = common.results_paths(BENCHMARK, common.device_kind(), args.out)
    common.write_results(md_path, json_path, markdown(record), record)
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
