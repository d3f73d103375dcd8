"""CPU kernels against the plain-PyTorch reference at N = 32K (a sanity check, not a GPU benchmark).

Shows that the CPU kernels are parallel and not pathologically slow. One row per op: median
milliseconds of our kernel and of the reference, their ratio, and the bytes the op must read
divided by our time. The results go to ``benchmarks/results/ops_cpu.{md,json}``, replacing an
earlier run's.

    python -m benchmarks.ops_cpu [--keys 32768] [--threads N] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hashattention as ha
from benchmarks import common
from hashattention import reference

BENCHMARK = "ops"


def median_ms(fn, repeats: int) -> float:
    """Median wall-clock milliseconds of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def markdown(record: dict) -> str:
    meta, shape = record["meta"], record["meta"]["shape"]
    lines = [f"# CPU kernels against the plain-PyTorch reference ({meta['device']})", "", *common.header_lines(meta),
             f"- shape: N = {shape['keys']}, Hq = {shape['query_heads']}, Hkv = {shape['kv_heads']}, "
             f"D = {shape['head_dim']}, bf16 K/V, sink = local = {shape['sink']}, budget {shape['budget']} "
             f"({shape['sparsity']}x); the reference is `hashattention.reference`", "",
             "| op | ours ms | reference ms | speedup | GB/s (ours) |", "|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['op']} | {r['ours_ms']:.2f} | {r['reference_ms']:.2f} | "
                     f"{r['reference_ms'] / r['ours_ms']:.1f}x | {r['gbps']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ops_cpu",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=32768, help="cached keys N")
    parser.add_argument("--query-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sparsity", type=int, default=16, help="n / s tokens attended, windows included")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    parser.add_argument("--out", default=None, help="folder of ops_cpu.{md,json} (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d = args.keys, args.query_heads, args.kv_heads, args.head_dim
    sink = local = 128
    budget = max(1, n // args.sparsity - sink - local)
    q = torch.randn(1, hq, 1, d, generator=g, dtype=torch.float32).bfloat16()
    k = torch.randn(1, hkv, n, d, generator=g).bfloat16()
    v = torch.randn(1, hkv, n, d, generator=g).bfloat16()
    weights = [torch.randn(hq, d, 128, generator=g) / d**0.5, torch.randn(hq, 128, 32, generator=g) / 11]
    biases = [torch.zeros(hq, 128), torch.zeros(hq, 32)]
    keys_per_q_head = k.repeat_interleave(hq // hkv, dim=1)
    q_sig = ha.encode_signatures(q, weights, biases)
    k_sig = ha.encode_signatures(keys_per_q_head, weights, biases)
    select = dict(selection_heads=hq, sink_tokens=sink, local_tokens=local, budget_tokens=budget)
    indices, counts = ha.hamming_topk(q_sig, k_sig, **select)
    scores = ha.hamming_scores(q_sig, k_sig, hq).float()
    width = indices.shape[-1]

    cases = [
        ("encode_signatures (all N keys)", lambda: ha.encode_signatures(keys_per_q_head, weights, biases),
         lambda: reference.encode_signatures(keys_per_q_head, weights, biases), keys_per_q_head.numel() * 2),
        ("hamming_scores", lambda: ha.hamming_scores(q_sig, k_sig, hq),
         lambda: reference.hamming_scores(q_sig, k_sig, hq), k_sig.numel() * 4),
        ("hamming_topk", lambda: ha.hamming_topk(q_sig, k_sig, **select),
         lambda: reference.hamming_topk(q_sig, k_sig, **select), k_sig.numel() * 4),
        ("topk_from_scores (float32)", lambda: ha.topk_from_scores(scores, sink_tokens=sink, local_tokens=local,
                                                                   budget_tokens=budget),
         lambda: reference.topk_from_scores(scores, sink_tokens=sink, local_tokens=local, budget_tokens=budget),
         scores.numel() * 4),
        ("sparse_attention (bf16)", lambda: ha.sparse_attention(q, k, v, indices, counts, scale=d**-0.5),
         lambda: reference.sparse_attention(q, k, v, indices, counts, scale=d**-0.5), hq * width * d * 2 * 2),
    ]
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; N = {n}, Hq = {hq}, Hkv = {hkv}, "
          f"D = {d}, sink = local = {sink}, budget = {budget} (sparsity {args.sparsity}x)")
    print(f"{'op':34s} {'ours ms':>9s} {'reference ms':>13s} {'speedup':>8s} {'GB/s':>7s}")
    rows = []
    for name, ours, ref, nbytes in cases:
        ours_ms = median_ms(ours, args.repeats)
        ref_ms = median_ms(ref, max(1, args.repeats // 2))
        rows.append(dict(op=name, ours_ms=ours_ms, reference_ms=ref_ms, bytes=nbytes, gbps=nbytes / ours_ms / 1e6))
        print(f"{name:34s} {ours_ms:9.2f} {ref_ms:13.2f} {ref_ms / ours_ms:7.1f}x {nbytes / ours_ms / 1e6:7.2f}")
    meta = common.run_metadata(common.command_line("benchmarks.ops_cpu", argv), torch.device("cpu"))
    meta["shape"] = dict(keys=n, query_heads=hq, kv_heads=hkv, head_dim=d, sink=sink, local=local, budget=budget,
                         sparsity=args.sparsity)
    record = dict(meta=meta, rows=rows)
    md_path, json_path = common.results_paths(BENCHMARK, "cpu", args.out)
    common.write_results(md_path, json_path, markdown(record), record)
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
