"""Per-kernel GPU times of one decode step's ops (selection and sparse attention), from torch.profiler.

The decode benchmark (``benchmarks.decode_attention``) times whole graph replays; this tool says
where that time goes: each CUDA kernel (and memset) that hamming_topk and sparse_attention launch,
its mean duration over the profiled steps, and the gap between launches that a graph replay pays.

    python -m tools.profile_ops                        # Llama-3.1-8B layer shapes, B = 1, 32x
    python -m tools.profile_ops --n 32768 131072 --sparsity 32 --selection query_head kv_group
    ncu --clock-control none -k regex:resident_select python -m tools.profile_ops --n 131072 --eager 3  # counters

The encoder of one decode step (a new query or key row per head: `encode_signatures` on
(B, 32, 1, 128) with bf16 MLP weights 128 -> 128 -> 32) is profiled the same way (--encode-batches), and so
is the pair a decode step actually runs (`encode_signatures_pair`: query and new key rows in one launch).

Shapes follow ``benchmarks.decode_attention``: 32 query heads, 8 KV heads, D = 128, bf16, sink = local = 128,
one signature word (32 bits) per head. Prints one table per configuration.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

import hashattention as ha

QUERY_HEADS, KV_HEADS, HEAD_DIM, SINK, LOCAL = 32, 8, 128, 128, 128


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m tools.profile_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[32768, 131072, 524288])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sparsity", type=int, nargs="+", default=[32])
    parser.add_argument("--selection", nargs="+", default=["query_head", "kv_group"],
                        choices=("query_head", "kv_group"))
    parser.add_argument("--steps", type=int, default=20, help="profiled graph replays")
    parser.add_argument("--encode-batches", type=int, nargs="*", default=[1, 4],
                        help="batch sizes of the decode-step encoder profile (none: skip it)")
    parser.add_argument("--eager", type=int, default=0,
                        help="instead of profiling, run each step this many times eagerly (for ncu)")
    return parser.parse_args()


def build_step(n: int, batch: int, sparsity: int, selection: str):
    """Inputs and a closure running select + attend once (what one layer's decode step launches)."""
    device = "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    # query_head: signatures of queries and keys per query head (the paper); kv_group: the 32 query
    # signatures select per KV head against key signatures per KV head.
    selection_heads = QUERY_HEADS if selection == "query_head" else KV_HEADS
    key_sig_heads = QUERY_HEADS if selection == "query_head" else KV_HEADS
    q_sig = torch.randint(-2**31, 2**31 - 1, (batch, QUERY_HEADS, 1, 1), generator=g, device=device, dtype=torch.int32)
    k_sig = torch.randint(-2**31, 2**31 - 1, (batch, key_sig_heads, n, 1), generator=g, device=device,
                          dtype=torch.int32)
    query = torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16)
    keys = torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16)
    values = torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16)
    budget = max(n // sparsity - SINK - LOCAL, 0)

    def step():
        indices, counts = ha.hamming_topk(q_sig, k_sig, selection_heads=selection_heads, sink_tokens=SINK,
                                          local_tokens=LOCAL, budget_tokens=budget)
        return ha.sparse_attention(query, keys, values, indices, counts, scale=HEAD_DIM**-0.5)

    return step


def build_encode_step(batch: int):
    """One decode step's query-side encoding: a row per query head through a 128 -> 128 -> 32 MLP."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 1, QUERY_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    sizes = (HEAD_DIM, 128, 32)
    weights = [torch.randn(QUERY_HEADS, i, o, generator=g, device="cuda").mul(i**-0.5).to(torch.bfloat16)
               for i, o in zip(sizes[:-1], sizes[1:])]
    biases = [torch.zeros(QUERY_HEADS, o, device="cuda", dtype=torch.bfloat16) for o in sizes[1:]]
    return lambda: ha.encode_signatures(x, weights, biases, "silu")


def build_encode_pair_step(batch: int):
    """One decode step's query and new-key encoding in one encode_signatures_pair launch: the key
    row of each KV head read by the per-query-head key MLPs (no repeated copy)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    query = torch.randn(batch, 1, QUERY_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    key = torch.randn(batch, 1, KV_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    sizes = (HEAD_DIM, 128, 32)

    def stack():
        weights = [torch.randn(QUERY_HEADS, i, o, generator=g, device="cuda").mul(i**-0.5).to(torch.bfloat16)
                   for i, o in zip(sizes[:-1], sizes[1:])]
        return weights, [torch.zeros(QUERY_HEADS, o, device="cuda", dtype=torch.bfloat16) for o in sizes[1:]]

    (qw, qb), (kw, kb) = stack(), stack()
    return lambda: ha.encode_signatures_pair(query, qw, qb, key, kw, kb, "silu")


def report(title: str, step, args) -> None:
    if args.eager:
        for _ in range(args.eager):
            step()
        torch.cuda.synchronize()
        print(f"{title}: ran {args.eager} eager steps")
        return
    replay_us, kernels = profile(step, args.steps)
    busy = sum(t for t, _ in kernels.values())
    print(f"\n{title}: graph replay {replay_us:.1f} us, kernels busy {busy:.1f} us, launch gaps {replay_us - busy:.1f} us")
    for name, (us, per_step) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:8.1f} us  x{per_step:.0f}  {name}")


def profile(step, steps: int):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_us = 1e3 * start.elapsed_time(end) / steps

    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    totals, calls = collections.defaultdict(float), collections.defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.replace("(anonymous namespace)::", "").replace("void ", "")
            name = name.split("(")[0].split("<")[0].split("::")[-1][:60]
            totals[name] += event.device_time if hasattr(event, "device_time") else event.cuda_time
            calls[name] += 1
    return replay_us, {name: (totals[name] / steps, calls[name] / steps) for name in totals}


def main():
    args = parse_args()
    if not (torch.cuda.is_available() and ha.WITH_CUDA):
        sys.exit("tools.profile_ops needs a GPU and the extension built with its CUDA kernels")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for selection in args.selection:
        for sparsity in args.sparsity:
            for n in args.n:
                report(f"{selection}, B={args.batch}, n={n}, {sparsity}x", build_step(n, args.batch, sparsity, selection), args)
    for batch in args.encode_batches:
        report(f"encode (query side of a decode step), B={batch}", build_encode_step(batch), args)
        report(f"encode pair (query and key of a decode step, one launch), B={batch}", build_encode_pair_step(batch), args)


if __name__ == "__main__":
    main()
