"""Serving: N concurrent requests through transformers' continuous batching, dense against ``paged|hashattention``.

A Llama-3.1-8B-shaped model with random bf16 weights and random bf16 adapters (``benchmarks.decode_loop``'s;
``--tiny``: the small model of the same structure, for CPU smoke tests). Per row, N requests of
``--prompt-tokens`` random tokens each are submitted at once to one continuous batching manager
(``model.continuous_batching_context_manager`` then ``manager.add_requests``: the public API that
``generate_batch`` wraps), greedy, ``--new-tokens`` tokens each (no end-of-sequence token), and the
results are read with ``manager.get_result``.

Methods: ``dense`` = the unpatched model with the best paged dense attention transformers offers on the
device: ``paged|flash_attention_2`` on CUDA when ``flash_attn`` imports, else ``paged|sdpa`` (recorded per
row as ``attention``); ``hash-<query_head|kv_group>-<sparsity|full>`` = ``hashattention.patch(model,
adapters, config)`` then the same calls, which run ``paged|hashattention`` (``full``: a budget above
every length of the row, which must give dense's tokens; ``tokens_equal_dense`` records whether it does).

Timestamps: the requests are added with ``record_timestamps=True``. transformers then stamps each
generated token with ``time.perf_counter()`` on the manager's generation thread when the token reaches
the host, in the batch update that follows every forward (the loop copies each batch's sampled tokens to
the host in any case, so the stamps add no device synchronisation). A stamp is therefore the host's
receive time of the token, not the end of its kernel; with async batching the next forward may already
run. Submission time is ``time.perf_counter()`` just before ``add_requests`` (after the manager's
CUDA-graph warm-up), and each request's TTFT is its first stamp minus its ``created_time`` (stamped
when it was added).

Per row:

- ``tokens/s``: all requests' generated tokens / (last token's stamp - submission);
- ``token latency`` median and p99: the gaps between consecutive tokens of a request, pooled over the
  requests; ``TTFT`` median (and max): first token's stamp - the request's creation;
- KV-cache and signature-page bytes: the paged cache's K/V tensors and ``paged|hashattention``'s
  signature pages as allocated, in total and per cache slot (token);
- the cache configuration the manager resolved (``block_size``, ``num_blocks``, ``max_batch_tokens``,
  CUDA graphs, async batching), sized by default for N x (prompt + new tokens) so runs are reproducible
  (``--block-size``, ``--num-blocks``, ``--max-batch-tokens`` override);
- ``peak GB``: the most GPU memory allocated from the manager's creation to its end;
- ``vs dense``: tokens/s over dense's in the same file (same prompt length and N).

transformers decides CUDA graphs and async batching from the attention: on for flash attention, off for
implementations it builds masks for or does not know (``paged|sdpa``, ``paged|hashattention``); rows
record the result, and ``--cuda-graphs on|off`` forces one setting for every method.

An untimed round of the same requests, with prompts cut to ``--warmup-prompt-tokens`` and 4 new
tokens, runs first in every row (``--no-warmup`` skips it).

Results: ``benchmarks/results/serving_<gpu>.{json,md}``, rewritten after every row; ``--merge`` adds rows
to an existing file (a row of the same prompt length, N and method replaced); ``--render`` rewrites the
Markdown from a results JSON.

    python -m benchmarks.serving --prompt-tokens 32768 --requests 4,8,16 --new-tokens 256 \\
        --methods dense,hash-query_head-16,hash-query_head-32
    python -m benchmarks.serving --prompt-tokens 131072 --requests 1,2,4 --new-tokens 256 --merge
    python -m benchmarks.serving --tiny --device cpu --prompt-tokens 48 --requests 2 --new-tokens 6 \\
        --methods dense,hash-query_head-full,hash-query_head-4 --out /tmp/serving     # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

from benchmarks import common
from benchmarks.decode_loop import build_adapters, build_model, int_list, model_config
from benchmarks.decode_loop_report import fmt, human_n
from benchmarks.generate import parse_method as parse_generate_method

BENCHMARK = "serving"
WARMUP_NEW_TOKENS = 4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--prompt-tokens", type=int_list, default=[32768], help="prompt length of every request")
    parser.add_argument("--requests", type=int_list, default=[4, 8, 16], help="N: concurrent requests")
    parser.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens of every request")
    parser.add_argument("--methods", default="dense,hash-query_head-16,hash-query_head-32",
                        help="comma-separated: dense, hash-<query_head|kv_group>-<sparsity|full>")
    parser.add_argument("--block-size", type=int, default=None, help="cache block size (default 256; tiny: 16)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="cache blocks (default: N x ceil((prompt + new tokens) / block size))")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="tokens per forward (default 8192, at most N x (prompt + new tokens))")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                        help="ContinuousBatchingConfig.use_cuda_graph: auto = transformers' choice (on for flash "
                             "attention only), on / off = forced for every method")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed round before each row")
    parser.add_argument("--warmup-prompt-tokens", type=int, default=512, help="prompt length of the untimed round")
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--local", type=int, default=128)
    parser.add_argument("--sparse-prompt-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's; tiny: 2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (CPU smoke tests)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-timeout-s", type=float, default=1800.0,
                        help="give up on a row when no result arrives for this long")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="skip (and record) rows that would start after this many seconds")
    parser.add_argument("--out", default=None, help="folder of serving_<gpu>.{json,md}")
    parser.add_argument("--merge", action="store_true", help="add rows to the existing results files")
    parser.add_argument("--render", metavar="JSON", default=None, help="rewrite the Markdown from a results JSON")
    args = parser.parse_args(argv)
    args.method_list = [m for m in args.methods.split(",") if m]
    for method in args.method_list:
        try:
            parse_method(method)
        except ValueError as error:
            parser.error(str(error))
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (token latency needs two tokens)")
    if min(args.requests) < 1 or min(args.prompt_tokens) < 1:
        parser.error("--requests and --prompt-tokens must be >= 1")
    if args.block_size is not None and args.block_size < 4:
        parser.error("--block-size must be >= 4 (transformers' minimum)")
    return args


def parse_method(name: str) -> dict:
    """``{"dense": bool, "selection", "sparsity" (None: full budget)}``: benchmarks.generate's names, no variants."""
    if "@" in name:
        raise ValueError(f"method {name!r}: serving has no @ variants (continuous batching ignores GenerationOptions)")
    method = parse_generate_method(name)
    method.pop("library_options", None)
    return method


# ---- cache sizing and bytes -----------------------------------------------------------------------------

def batching_settings(args, prompt: int, requests: int) -> dict:
    """ContinuousBatchingConfig arguments sized for ``requests`` x (prompt + new tokens), or the overrides."""
    block_size = args.block_size or (16 if args.tiny else 256)
    per_request = prompt + args.new_tokens
    num_blocks = args.num_blocks or requests * math.ceil(per_request / block_size)
    max_batch_tokens = args.max_batch_tokens or min(8192, requests * per_request)
    settings = dict(block_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                    max_requests_per_batch=requests)
    if args.cuda_graphs != "auto":
        settings["use_cuda_graph"] = args.cuda_graphs == "on"
    return settings


def cache_bytes(cache) -> dict:
    """K/V and signature-page bytes of a ``PagedAttentionCache``, in total and per slot (token)."""
    from hashattention import signature_pages

    slots = int(cache.key_cache[0].shape[0])
    kv = sum(t.numel() * t.element_size() for t in list(cache.key_cache) + list(cache.value_cache))
    pages = signature_pages.signature_pages(cache)  # none allocated on a dense model's cache
    signatures = sum(t.numel() * t.element_size() for t in pages.layers.values())
    return {"cache_slots": slots, "kv_bytes": kv, "signature_bytes": signatures,
            "kv_bytes_per_token": kv / slots, "signature_bytes_per_token": signatures / slots}


# ---- one round ------------------------------------------------------------------------------------------

def dense_attention(device) -> str:
    """The paged dense attention of a dense row: flash attention 2 on CUDA where it imports, else SDPA."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "paged|flash_attention_2"
    return "paged|sdpa"


def prompts(vocab: int, prompt: int, requests: int, seed: int) -> List[List[int]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(3, vocab, (requests, prompt), generator=g).tolist()


def serve(model, inputs: List[List[int]], new_tokens: int, settings: dict, timeout_s: float,
          measure_cache: bool = False) -> dict:
    """Submit every request at once to one continuous batching manager and collect the finished outputs.

    Returns ``{"submitted": perf_counter time, "outputs": [GenerationOutput] in request order, "config":
    the resolved cache configuration, "bytes": cache_bytes (measure_cache)}``.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0)
    results: Dict[str, object] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(**settings),
    ) as manager:
        submitted = time.perf_counter()
        ids = manager.add_requests(inputs, max_new_tokens=new_tokens, record_timestamps=True)
        while len(results) < len(ids):
            result = manager.get_result(timeout=timeout_s)
            if result is None:
                raise RuntimeError(f"no result for {timeout_s} s ({len(results)} of {len(ids)} requests finished; "
                                   f"manager running: {manager.is_running()})")
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
        processor = manager.batch_processor
        cache = processor.cache
        resolved = manager.continuous_batching_config
        config = {"attention": model.config._attn_implementation, "block_size": int(cache.block_size),
                  "num_blocks": int(cache.num_blocks), "max_batch_tokens": int(cache.max_batch_tokens),
                  "max_requests_per_batch": resolved.max_requests_per_batch,
                  "use_cuda_graph": list(resolved.use_cuda_graph) if isinstance(resolved.use_cuda_graph, tuple)
                  else resolved.use_cuda_graph,
                  "use_async_batching": getattr(processor, "use_async_batching", resolved.use_async_batching)}
        measured = cache_bytes(cache) if measure_cache else None
    return {"submitted": submitted, "outputs": [results[i] for i in ids], "config": config, "bytes": measured}


def quantile(values: List[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def timing(round_: dict) -> dict:
    """tokens/s, token latency and TTFT of a finished round of requests (see the module docstring)."""
    submitted, outputs = round_["submitted"], round_["outputs"]
    gaps, ttfts, last, generated = [], [], submitted, 0
    for output in outputs:
        stamps = output.timestamps or []
        if len(stamps) != len(output.generated_tokens) or not stamps:
            raise RuntimeError(f"request {output.request_id}: {len(stamps)} timestamps for "
                               f"{len(output.generated_tokens)} tokens")
        generated += len(output.generated_tokens)
        ttfts.append(stamps[0] - output.created_time)
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        last = max(last, stamps[-1])
    wall = last - submitted
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
            "token_latency_ms_median": 1e3 * statistics.median(gaps),
            "token_latency_ms_p99": 1e3 * quantile(gaps, 0.99),
            "ttft_s_median": statistics.median(ttfts), "ttft_s_max": max(ttfts)}


# ---- rows -----------------------------------------------------------------------------------------------

def hash_config(method: dict, args, prompt: int):
    from hashattention import HashAttentionConfig

    # "full": a budget above every length of the row, so HashAttention must reproduce dense's tokens.
    budget = dict(sparsity=method["sparsity"]) if method["sparsity"] else dict(
        budget_tokens=prompt + args.new_tokens + 256)
    return HashAttentionConfig(**budget, sink_tokens=args.sink, local_tokens=args.local,
                               selection=method["selection"], sparse_prompt_tokens=args.sparse_prompt_tokens)


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_row(model, adapters_by_family: Dict, args, device, prompt: int, requests: int, name: str) -> dict:
    import hashattention

    method = parse_method(name)
    row = {"prompt_tokens": prompt, "requests": requests, "method": name}
    settings = batching_settings(args, prompt, requests)
    inputs = prompts(model.config.vocab_size, prompt, requests, args.seed + prompt + requests)
    original = model.config._attn_implementation
    handle = None
    try:
        if method["dense"]:
            attention = dense_attention(device)
            try:
                model.set_attn_implementation(attention)
            except (ImportError, ValueError) as error:  # flash attention found but not usable here
                row["attention_fallback"] = f"{attention}: {str(error).splitlines()[0][:160]}"
                model.set_attn_implementation("paged|sdpa")
        else:
            family = "query" if method["selection"] == "query_head" else "kv"
            handle = hashattention.patch(model, adapters_by_family[family], hash_config(method, args, prompt))
        if not args.no_warmup:
            cut = [ids[: max(1, min(prompt, args.warmup_prompt_tokens))] for ids in inputs]
            serve(model, cut, WARMUP_NEW_TOKENS, settings, args.result_timeout_s)
        release(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        measured = serve(model, inputs, args.new_tokens, settings, args.result_timeout_s, measure_cache=True)
        row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        row.update(timing(measured))
        row["cache"] = measured["config"]
        row["attention"] = measured["config"]["attention"]
        row.update(measured["bytes"])
        row["tokens"] = [list(map(int, o.generated_tokens)) for o in measured["outputs"]]
    except (torch.cuda.OutOfMemoryError, MemoryError) as error:  # MemoryError: transformers' cache sizing check
        row["skipped"] = f"out of memory: {str(error).splitlines()[0][:160]}"
    finally:
        if handle is not None:
            hashattention.unpatch(model)
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)
        release(device)
    return row


def compare_with_dense(rows: List[dict]) -> None:
    """Set ``vs_dense`` (tokens/s ratio) and ``tokens_equal_dense`` on every measured HashAttention row."""
    dense = {(r["prompt_tokens"], r["requests"]): r for r in rows if r["method"] == "dense" and "skipped" not in r}
    for r in rows:
        base = dense.get((r["prompt_tokens"], r["requests"]))
        if r["method"] == "dense" or "skipped" in r:
            continue
        r["vs_dense"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["tokens_equal_dense"] = r["tokens"] == base["tokens"] if base else None


def cell(text: str) -> str:
    """Text for a Markdown table cell (``paged|sdpa``'s bar escaped)."""
    return text.replace("|", "\\|")


def markdown(record: dict) -> str:
    meta = record["meta"]
    lines = [f"# Serving with continuous batching: {meta['model']} (random {meta['dtype']} weights)", ""]
    lines += common.header_lines(meta)
    lines += [
        f"- N requests of `prompt` random tokens, all submitted at once to one continuous batching manager, greedy, "
        f"{record['new_tokens']} new tokens each; token stamps = host receive time of each token on the manager's "
        "thread (transformers' `record_timestamps`, no added synchronisation); tokens/s = all generated tokens / "
        "(last token - submission); latency = gaps between a request's consecutive tokens, pooled; TTFT = a "
        "request's first token - its creation; KV / sig. B/token = the paged cache's K/V and signature-page bytes "
        "per cache slot (totals in GB); cache = block size x blocks (max batch tokens); peak = most GPU memory "
        "allocated during the timed round; an untimed round with short prompts runs first"
        + (" (not in this run)." if meta.get("no_warmup") else "."),
        f"- methods: `dense` = the unpatched model with transformers' paged dense attention (column `attention`); "
        f"`hash-<selection>-<s>` = `hashattention.patch` (`paged|hashattention`), windows {meta['sink']} + "
        f"{meta['local']}, last {meta['sparse_prompt_tokens']} prompt tokens sparse; `full` = budget above every "
        "length (must give dense's tokens).",
        "",
        "| prompt | N | method | attention | tokens/s | vs dense | latency ms p50 | latency ms p99 | TTFT s p50 | "
        "KV B/token | sig. B/token | KV GB | sig. GB | cache | peak GB | tokens = dense | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        head = f"| {human_n(r['prompt_tokens'])} | {r['requests']} | {r['method']} |"
        if "skipped" in r:
            lines.append(head + " - |" * 13 + f" skipped: {cell(r['skipped'])} |")
            continue
        cache = r["cache"]
        equal = r.get("tokens_equal_dense")
        notes = [r["attention_fallback"]] if r.get("attention_fallback") else []
        lines.append(
            f"{head} {cell(r['attention'])} | {r['tokens_per_s']:.1f} | "
            f"{fmt(r.get('vs_dense'), '.2f') + ('x' if r.get('vs_dense') else '')} | "
            f"{r['token_latency_ms_median']:.2f} | {r['token_latency_ms_p99']:.2f} | {r['ttft_s_median']:.3f} | "
            f"{r['kv_bytes_per_token']:.0f} | {r['signature_bytes_per_token']:.0f} | {r['kv_bytes'] / 1e9:.3g} | "
            f"{r['signature_bytes'] / 1e9:.3g} | {cache['block_size']} x {cache['num_blocks']} "
            f"({cache['max_batch_tokens']}) | {fmt(r.get('peak_gb'), '.1f')} | "
            f"{'-' if equal is None else ('yes' if equal else 'no')} | {cell('; '.join(notes))} |")
    return "\n".join(lines) + "\n"


def render(json_path: str) -> dict:
    return common.render_markdown(json_path, markdown)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = model_config(args, max(args.prompt_tokens) + args.new_tokens)
    torch.manual_seed(args.seed)
    model = build_model(config, device, dtype)
    model.generation_config.pad_token_id = 0
    families = {("query" if parse_method(m).get("selection") == "query_head" else "kv")
                for m in args.method_list if not parse_method(m)["dense"]}
    adapters = {}
    for family in sorted(families):
        torch.manual_seed(args.seed + 1)
        adapters[family] = build_adapters(config, family, device, dtype)
    md_path, json_path = common.results_paths(BENCHMARK, common.device_kind(device), args.out)
    meta = {**common.run_metadata(common.command_line("benchmarks.serving", argv), device),
            "model": "tiny Llama" if args.tiny else "Llama-3.1-8B shape", "dtype": str(dtype).replace("torch.", ""),
            "sink": args.sink, "local": args.local, "sparse_prompt_tokens": args.sparse_prompt_tokens,
            "no_warmup": args.no_warmup, "dense_attention": dense_attention(device),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    record = {"meta": meta, "new_tokens": args.new_tokens, "rows": []}
    if args.merge and os.path.exists(json_path):
        with open(json_path) as f:
            record["rows"] = json.load(f)["rows"]
    key = lambda r: (r["prompt_tokens"], r["requests"], r["method"])  # noqa: E731
    for prompt in args.prompt_tokens:
        for requests in args.requests:
            for name in args.method_list:
                if args.time_budget_s is not None and time.perf_counter() - started > args.time_budget_s:
                    row = {"prompt_tokens": prompt, "requests": requests, "method": name, "skipped": "time budget"}
                else:
                    print(f"prompt={prompt} N={requests} {name}", flush=True)
                    row = run_row(model, adapters, args, device, prompt, requests, name)
                    print("   ", {k: v for k, v in row.items() if k != "tokens"}, flush=True)
                record["rows"] = [r for r in record["rows"] if key(r) != key(row)] + [row]
                compare_with_dense(record["rows"])
                common.write_results(md_path, json_path, markdown(record), record)
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
