"""The user's path: ``hashattention.patch`` then ``model.generate``, against the dense model's ``generate``.

A Llama-3.1-8B-shaped model with random bf16 weights (``benchmarks.decode_loop``'s) and random bf16
adapters. For every context n, batch B, cache and method, with random prompt tokens and greedy
decoding, only the public API is called: ``hashattention.patch(model, adapters, config)`` (default
:class:`hashattention.GenerationOptions`) and ``model.generate(input_ids, attention_mask=...,
max_new_tokens=..., cache_implementation="static")`` (auto-compiled by transformers) or without
``cache_implementation`` (transformers' dynamic cache, eager).

Per row:

1. a first call (compiles the static-cache decode step) and a timed second call, each generating
   ``--new-tokens`` tokens; ``compile s`` = first call's wall time minus the second's;
2. timing inside the timed call, without adding a host synchronisation: a logits processor records a
   CUDA event at every token (events are asynchronous), so ``TTFT`` is the time from the call's start
   to the first token's logits and ``decode ms/token`` the mean time between tokens after the first
   ``--skip-tokens`` (CUDA-graph re-recording for the new cache happens there); tokens/s = B / that;
3. ``peak GB``: the most GPU memory allocated during the timed call;
4. ``recompiles``: how often dynamo compiled after the first call, over the timed call and (with
   ``--recompile-check``, HashAttention rows) one more call with 128 more new tokens and a prompt 64
   tokens shorter (the same cache bucket); ``cudagraph skips``: inductor's count of graphs run without
   CUDA graphs, since the start of the process;
5. ``decode loop``: the same compiled step that ``generate`` used (static cache), called back to back
   with the argmax fed back on the device, on the cache of the timed call -- the decode-loop
   benchmark's way of timing a step; ``generate / loop`` is what transformers' loop adds;
6. ``floor ms``: the bytes one decode step must read -- the weights but the embedding table, the K/V
   rows it attends to (dense: every valid row; HashAttention: each query head's, or each KV group's,
   selected rows) and every valid key's signatures -- over the copy bandwidth measured at the start
   (a 1 GiB device-to-device copy, read + written bytes per second); ``/ floor`` = decode ms/token
   over it;
7. ``--profile-tokens``: a profile (torch.profiler) of one more call's decode steps: host syncs per
   token, host time in CUDA API calls, kernel time by category.

Methods: ``dense`` (transformers' ``sdpa`` attention, its own compile settings: what a user runs
without HashAttention), ``hash-<query_head|kv_group>-<sparsity|full>`` (``full``: a budget above every length, which must
give dense's tokens); a method ending in ``@transformers``
patches with ``GenerationOptions(compile_options=False, cache_bucket_tokens=0, defer_stop_check=False)``,
i.e. ``generate`` as transformers sets it up (for the before/after comparison).

Results: ``benchmarks/results/generate_<gpu>.{json,md}``, rewritten after every row; ``--merge`` adds
rows to an existing file (a row with the same key replaced).

    python -m benchmarks.generate --contexts 8192,32768,131072 --batches 1
    python -m benchmarks.generate --tiny --device cpu --contexts 64 --batches 1 --caches dynamic \\
        --methods dense,hash-query_head-4 --new-tokens 6 --skip-tokens 1 --out /tmp/generate

Tensor parallel (``--tensor-parallel``, launched by torchrun; ``benchmarks.generate_parallel`` builds
each rank's shards): every rank runs the same calls on its shard, rank 0 alone writes the results
(its timings and its peak memory; ``tp`` = the number of ranks).

    torchrun --nproc_per_node 2 -m benchmarks.generate --tensor-parallel --contexts 131072 --batches 1,4 \\
        --methods dense,hash-query_head-32
    torchrun --nproc_per_node 8 -m benchmarks.generate --tensor-parallel --model llama-70b-shape \\
        --contexts 32768,131072 --batches 1,4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch

from benchmarks import common
from benchmarks import generate_parallel as parallel
from benchmarks.decode_loop import build_adapters, build_model, int_list
from benchmarks.decode_loop_report import fmt, human_n
from benchmarks.decode_loop_profile import SYNC_CALLS, is_cuda_api_call, kernel_category

BENCHMARK = "generate"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--contexts", type=int_list, default=[8192, 32768, 131072], help="prompt tokens n")
    parser.add_argument("--batches", type=int_list, default=[1, 4], help="B")
    parser.add_argument("--caches", default="static", help="comma-separated: static, dynamic")
    parser.add_argument("--methods", default="dense,hash-query_head-32",
                        help="comma-separated: dense, hash-<query_head|kv_group>-<sparsity>[@transformers]")
    parser.add_argument("--new-tokens", type=int, default=72, help="max_new_tokens of the timed call")
    parser.add_argument("--skip-tokens", type=int, default=8, help="tokens not counted in decode ms/token")
    parser.add_argument("--loop-steps", type=int, default=64, help="decode-loop steps timed on the same step")
    parser.add_argument("--profile-tokens", type=int, default=0, help="profile a call of this many new tokens")
    parser.add_argument("--recompile-check", action="store_true",
                        help="one more call per row, with a prompt 64 tokens shorter and 128 more new tokens (the same "
                             "cache bucket): counts dynamo compiles")
    parser.add_argument("--sink", type=int, default=128)
    # --local-tokens: torchrun's own parser rejects --local, in the script's arguments too, as an ambiguous
    # abbreviation of its --local-addr / --local-ranks-filter.
    parser.add_argument("--local", "--local-tokens", dest="local", type=int, default=128,
                        help="local window (under torchrun: --local-tokens)")
    parser.add_argument("--sparse-prompt-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's; tiny: 2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (CPU smoke tests)")
    parser.add_argument("--model", choices=tuple(parallel.MODEL_SHAPES), default=None,
                        help=f"the decoder's shape, random weights (default {parallel.DEFAULT_MODEL})")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="shard the model over the torchrun processes (transformers' tp_plan='auto'); rank 0 "
                             "writes the results")
    parser.add_argument("--tp-weights", choices=parallel.WEIGHTS, default=None,
                        help="with --tensor-parallel: seeded = the single-process run's weights, built whole on each "
                             "rank's host and sliced (default with --tiny); sharded = each rank initialises only its "
                             "shards on its device (default otherwise)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder of generate_<gpu>.{json,md}")
    parser.add_argument("--merge", action="store_true", help="add rows to the existing results files")
    parser.add_argument("--render", metavar="JSON", default=None, help="rewrite the Markdown from a results JSON")
    parser.add_argument("--time-budget-s", type=float, default=560.0,
                        help="skip (and record) rows that would start after this many seconds")
    args = parser.parse_args(argv)
    args.cache_list = [c for c in args.caches.split(",") if c]
    if not set(args.cache_list) <= {"static", "dynamic"}:
        parser.error("--caches: static and/or dynamic")
    args.method_list = [m for m in args.methods.split(",") if m]
    for method in args.method_list:
        try:
            parse_method(method)
        except ValueError as error:
            parser.error(str(error))
    if args.skip_tokens < 1 or args.new_tokens < args.skip_tokens + 2:
        parser.error("--skip-tokens must be >= 1 and --new-tokens >= --skip-tokens + 2")
    if args.tiny and args.model:
        parser.error("--tiny and --model: the tiny model has its own shape")
    args.model = args.model or parallel.DEFAULT_MODEL
    if args.tp_weights and not args.tensor_parallel:
        parser.error("--tp-weights needs --tensor-parallel")
    args.tp_weights = args.tp_weights or ("seeded" if args.tiny else "sharded")
    return args


def parse_method(name: str) -> dict:
    """``{"dense": bool, "selection", "sparsity" (None: full budget), "library_options": bool}`` of a method name."""
    base, _, variant = name.partition("@")
    if variant not in ("", "transformers"):
        raise ValueError(f"method {name!r}: the only variant is @transformers")
    if base == "dense":
        if variant:
            raise ValueError("dense has no @transformers variant (it always runs transformers' settings)")
        return {"dense": True}
    parts = base.split("-")
    if len(parts) != 3 or parts[0] != "hash" or parts[1] not in ("query_head", "kv_group"):
        raise ValueError(f"method {name!r}: expected dense or hash-<query_head|kv_group>-<sparsity|full>")
    try:
        sparsity = None if parts[2] == "full" else float(parts[2])
    except ValueError:
        raise ValueError(f"method {name!r}: sparsity {parts[2]!r} is not a number or 'full'") from None
    return {"dense": False, "selection": parts[1], "sparsity": sparsity, "library_options": not variant}


class TokenClock:
    """A logits processor that records a CUDA event per generated token (no synchronisation) and
    leaves the scores unchanged; on CPU it records perf_counter times."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks: List = []

    def __call__(self, input_ids, scores):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return scores

    def start(self):
        self.marks = []
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        else:
            self.origin = time.perf_counter()

    def seconds_since_start(self) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [self.origin.elapsed_time(e) / 1e3 for e in self.marks]
        return [t - self.origin for t in self.marks]


class CacheCapture:
    """Forward pre-hook on the model: keeps the kwargs of the last single-token forward (the decode step's
    inputs as generate passed them) and the cache they carried."""

    def __init__(self):
        self.decode_kwargs: Optional[Dict] = None
        self.active = False

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if self.active and ids is not None and ids.shape[-1] == 1 and kwargs.get("past_key_values") is not None:
            self.decode_kwargs = dict(kwargs)
        return None


def compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


def generate_once(model, ids, mask, new_tokens: int, cache: str, clock: Optional[TokenClock]):
    from transformers import LogitsProcessorList

    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    if clock is not None:
        kwargs["logits_processor"] = LogitsProcessorList([clock])
    return model.generate(ids, **kwargs)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_loop_unavailable(model, capture: CacheCapture, steps: int) -> Optional[str]:
    """Why :func:`time_decode_loop` cannot time this row (None: it can). Under tensor parallelism every
    rank reaches the same answer (the same shapes and positions), so all of them time it or none."""
    if getattr(model, "_compiled_call", None) is None:
        return "generate compiled no decode step (transformers compiles on CUDA only)"
    kwargs = capture.decode_kwargs
    if kwargs is None:
        return "no single-token forward was seen"
    layers = getattr(kwargs["past_key_values"], "layers", [])
    if not layers or not hasattr(layers[0], "cumulative_length"):
        return "the cache cannot be rewound (no cumulative_length)"
    if int(kwargs["position_ids"][0, -1]) - steps - 2 < 1:
        return f"fewer cached positions than --loop-steps {steps} + 2"
    return None


def time_decode_loop(model, capture: CacheCapture, steps: int, device) -> Optional[float]:
    """ms per step of the compiled step ``generate`` used, called back to back on its last cache (None:
    see :func:`decode_loop_unavailable`). Under tensor parallelism every rank calls the same step the
    same number of times (the argmax of the gathered logits is equal on every rank), so the
    collectives inside the step pair up."""
    if decode_loop_unavailable(model, capture, steps):
        return None
    compiled = model._compiled_call
    kwargs = capture.decode_kwargs
    layers = kwargs["past_key_values"].layers
    start = int(kwargs["position_ids"][0, -1]) - steps - 2  # rewind so that the steps fit the cache
    mask = kwargs.get("attention_mask")
    slots = torch.arange(mask.shape[-1], device=device) if mask is not None else None
    token = kwargs["input_ids"]
    positions = torch.full_like(kwargs["position_ids"], start)

    def run(count: int):
        nonlocal token, positions
        for _ in range(count):
            step = dict(kwargs)
            step["input_ids"], step["position_ids"] = token, positions
            if mask is not None:  # the keys up to this position, as generate's mask would show them
                step["attention_mask"] = (slots <= positions[:, -1:]).view(mask.shape[0], 1, 1, -1).expand_as(mask)
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(**step)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            positions = positions + 1

    with torch.no_grad():
        for layer in layers:
            layer.cumulative_length.fill_(start)
        run(2)  # graph replays for this cache are recorded
        for layer in layers:
            layer.cumulative_length.fill_(start)
        positions = torch.full_like(kwargs["position_ids"], start)
        sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        run(steps)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / steps
        return 1e3 * (time.perf_counter() - t0) / steps


def profile_generate(model, ids, mask, new_tokens: int, cache: str, device) -> dict:
    """Kernel time by category, host syncs and host time in CUDA API calls, per generated token."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as empty:
        pass
    baseline = {e.key: e.count for e in empty.key_averages() if e.key in SYNC_CALLS}
    with profile(activities=activities) as prof:
        generate_once(model, ids, mask, new_tokens, cache, None)
    sync(device)
    per = float(new_tokens)
    syncs, host, categories = {}, {}, {}
    for event in prof.key_averages():
        if event.key in SYNC_CALLS and event.count > baseline.get(event.key, 0):
            syncs[event.key] = (event.count - baseline.get(event.key, 0)) / per
        if getattr(event, "device_type", None) == DeviceType.CPU and is_cuda_api_call(event.key):
            host[event.key] = {"host_us_per_token": event.cpu_time_total / per, "calls_per_token": event.count / per}
        if getattr(event, "device_type", None) == DeviceType.CUDA:
            micros = getattr(event, "self_device_time_total", 0.0)
            category = kernel_category(event.key)
            categories[category] = categories.get(category, 0.0) + micros / per
    top_host = dict(sorted(host.items(), key=lambda kv: -kv[1]["host_us_per_token"])[:8])
    return {"tokens": new_tokens, "note": "whole call (prefill included) divided by its tokens",
            "host_sync_calls_per_token": syncs, "host_calls_us_per_token": top_host,
            "kernel_us_per_token_by_category": categories}


def copy_bandwidth(device) -> Optional[float]:
    """Bytes per second a device-to-device copy moves (read + written; 1 GiB, best of 5); None on the CPU."""
    if device.type != "cuda":
        return None
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    del source, target
    return 2 * (1 << 30) / best


def step_read_bytes(model, method: dict, config, n: int, batch: int, tp: int = 1) -> Dict[str, int]:
    """What one decode step must read at least: the weights (all but the embedding table, of which it
    reads one row), the K/V rows it attends to and (HashAttention) every valid key's signatures.
    Tensor parallel (``tp`` ranks): what one rank reads, i.e. its weight shards and its heads' rows."""
    text = model.config
    layers, kv_heads, heads, head_dim = (text.num_hidden_layers, text.num_key_value_heads // tp,
                                         text.num_attention_heads // tp, text.head_dim)
    element = next(model.parameters()).element_size()
    embedding = model.get_input_embeddings().weight
    weights = sum(parallel.local_bytes(p) for p in model.parameters()) - parallel.local_bytes(embedding)
    if method["dense"]:
        return {"weights": weights, "kv": 2 * layers * batch * kv_heads * n * head_dim * element, "signatures": 0}
    readers = heads if method["selection"] == "query_head" else kv_heads  # each reads its own rows
    rows = config.total_tokens(n)
    signature_heads = heads if method["selection"] == "query_head" else kv_heads  # the adapters' key heads
    return {"weights": weights, "kv": 2 * layers * batch * readers * rows * head_dim * element,
            "signatures": layers * batch * signature_heads * n * 4}  # one 32-bit word per key and head


def hash_config(method: dict, args):
    from hashattention import HashAttentionConfig

    # "full": a budget above every length of the run, so HashAttention must reproduce dense's tokens.
    budget = dict(sparsity=method["sparsity"]) if method["sparsity"] else dict(
        budget_tokens=max(args.contexts) + args.new_tokens + 256)
    return HashAttentionConfig(**budget, sink_tokens=args.sink, local_tokens=args.local,
                               selection=method["selection"], sparse_prompt_tokens=args.sparse_prompt_tokens)


def patch_for(model, method: dict, adapters_by_family: Dict, args):
    import hashattention
    from hashattention import GenerationOptions

    config = hash_config(method, args)
    options = GenerationOptions() if method["library_options"] else GenerationOptions(
        compile_options=False, cache_bucket_tokens=0, defer_stop_check=False)
    family = "query" if method["selection"] == "query_head" else "kv"
    return hashattention.patch(model, adapters_by_family[family], config, generation_options=options)


def release(model, device):
    from benchmarks.decode_loop import release as release_compiled

    for name in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length", "_cache"):
        model.__dict__.pop(name, None)
    release_compiled(device)
    gc.collect()


def run_row(model, adapters_by_family, args, device, n: int, batch: int, cache: str, name: str,
            bandwidth: Optional[float] = None) -> dict:
    from hashattention import unpatch

    method = parse_method(name)
    tp = parallel.rank_and_world()[1] if args.tensor_parallel else 1
    row = {"n": n, "B": batch, "tp": tp, "cache": cache, "method": name}
    reads = step_read_bytes(model, method, None if method["dense"] else hash_config(method, args), n, batch, tp)
    row["read_bytes"] = reads
    if bandwidth:
        row["floor_ms"] = 1e3 * sum(reads.values()) / bandwidth
    g = torch.Generator(device="cpu").manual_seed(args.seed + n + batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, n), generator=g).to(device)
    mask = torch.ones_like(ids)
    release(model, device)
    handle = None if method["dense"] else patch_for(model, method, adapters_by_family, args)
    capture = CacheCapture()
    hook = model.register_forward_pre_hook(capture, with_kwargs=True)
    clock = TokenClock(device)
    try:
        t0 = time.perf_counter()
        generate_once(model, ids, mask, args.new_tokens, cache, None)
        sync(device)
        first_s = time.perf_counter() - t0
        compiles_after_first = compile_count()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        clock.start()
        capture.active = True
        t0 = time.perf_counter()
        out = generate_once(model, ids, mask, args.new_tokens, cache, clock)
        sync(device)
        wall_s = time.perf_counter() - t0
        capture.active = False
        marks = clock.seconds_since_start()
        row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        row["compile_s"] = max(0.0, first_s - wall_s) if cache == "static" else None
        row["wall_s"] = wall_s
        row["ttft_s"] = marks[0]
        steps = len(marks) - 1 - args.skip_tokens
        row["decode_ms_per_token"] = 1e3 * (marks[-1] - marks[args.skip_tokens]) / steps
        row["tokens_per_s"] = batch * 1e3 / row["decode_ms_per_token"]
        if row.get("floor_ms"):
            row["over_floor"] = row["decode_ms_per_token"] / row["floor_ms"]
        row["tokens"] = out[:, n:].tolist()
        del out
        if cache == "static":
            loop_ms = time_decode_loop(model, capture, args.loop_steps, device)
            row["loop_ms_per_step"] = loop_ms
            row["generate_over_loop"] = row["decode_ms_per_token"] / loop_ms if loop_ms else None
            if loop_ms is None:
                row["loop_skipped"] = decode_loop_unavailable(model, capture, args.loop_steps)
        capture.decode_kwargs = None  # its cache: freed before the next call allocates one (dense)
        if args.recompile_check and not method["dense"]:
            # More new tokens and a shorter prompt, same bucket: must reuse the compiled step.
            shorter = max(1, n - 64)
            generate_once(model, ids[:, :shorter], mask[:, :shorter], args.new_tokens + 128, cache, None)
            sync(device)
        row["recompiles"] = compile_count() - compiles_after_first
        row["cudagraph_skips"] = cudagraph_skips()
        if args.profile_tokens:
            row["profile"] = profile_generate(model, ids, mask, args.profile_tokens, cache, device)
    except torch.cuda.OutOfMemoryError as error:
        row["skipped"] = f"out of memory: {str(error).splitlines()[0][:160]}"
    finally:
        hook.remove()
        capture.decode_kwargs = None
        if handle is not None:
            unpatch(model)
        release(model, device)
    return row


def markdown(record: dict) -> str:
    meta = record["meta"]
    tp = meta.get("tensor_parallel", 1)
    sharded = f", tensor parallel over {tp} processes" if tp > 1 else ""
    lines = [f"# `model.generate` on a patched model: {meta['model']} (random {meta['dtype']} weights{sharded})", ""]
    lines += common.header_lines(meta)
    if tp > 1:
        lines.append(f"- tensor parallel: {tp} ranks (transformers' tp_plan='auto', {meta['tp_weights']} weights); every "
                     "rank runs the same calls; timings, peak GB and floor bytes are rank 0's (its shard of the "
                     "weights, its heads' K/V and signatures); rank 0 holds "
                     f"{meta['rank_parameter_bytes'] / 1e9:.3g} of the model's {meta['parameter_bytes'] / 1e9:.3g} GB "
                     "of weights")
    lines += [
        "- greedy, prompt of n random tokens, `max_new_tokens` = " + str(record["new_tokens"]) +
        f"; decode ms/token over tokens {record['skip_tokens'] + 1}..{record['new_tokens'] - 1} of one call (CUDA "
        "events at each token, no added synchronisation); TTFT = call start to the first token's logits; "
        "tokens/s = B / decode time per token; peak = most GPU memory allocated in the call; recompiles = dynamo "
        "compiles after the first call (with --recompile-check also over a call with 128 more new tokens and a prompt "
        "64 tokens shorter); "
        "loop = the same compiled step called back to back (the decode-loop benchmark's timing); floor = bytes a "
        "step must read (weights, attended K/V rows, signatures) over the measured copy bandwidth ("
        + fmt(meta.get("copy_bandwidth_gb_per_s"), ".0f") + " GB/s); "
        "windows " + f"{meta['sink']} + {meta['local']}, last {meta['sparse_prompt_tokens']} prompt tokens sparse.",
        "- methods: `dense` = transformers' sdpa attention with its own compile settings; `hash-<selection>-<s>` = "
        "`hashattention.patch` with default `GenerationOptions`; `@transformers` = patched, generate as "
        "transformers sets it up.",
        "",
        "| n | B | tp | cache | method | decode ms/token | tokens/s | vs dense | loop ms/step | generate / loop | "
        "floor ms | / floor | TTFT s | TTFT vs dense | peak GB | compile s | recompiles | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    dense = {(r["n"], r["B"], r.get("tp", 1), r["cache"]): r for r in record["rows"]
             if r["method"] == "dense" and "skipped" not in r}
    for r in record["rows"]:
        base = dense.get((r["n"], r["B"], r.get("tp", 1), r["cache"]))
        if "skipped" in r:
            lines.append(f"| {human_n(r['n'])} | {r['B']} | {r.get('tp', 1)} | {r['cache']} | {r['method']} | - | - | "
                         f"- | - | - | - | - | - | - | - | - | - | skipped: {r['skipped']} |")
            continue
        speed = (f"{base['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x"
                 if base and r is not base else "-")
        ttft = f"{r['ttft_s'] / base['ttft_s']:.3f}" if base and r is not base else "-"
        notes = []
        if r.get("loop_skipped") and r["cache"] == "static":
            notes.append(f"loop not timed: {r['loop_skipped']}")
        if r.get("cudagraph_skips"):
            notes.append(f"CUDA graphs skipped {r['cudagraph_skips']}x in the process so far")
        if r.get("profile"):
            syncs = r["profile"]["host_sync_calls_per_token"]
            notes.append("host syncs/token: " + (", ".join(f"{k} {v:.2f}" for k, v in syncs.items()) or "none"))
        lines.append(
            f"| {human_n(r['n'])} | {r['B']} | {r.get('tp', 1)} | {r['cache']} | {r['method']} | "
            f"{r['decode_ms_per_token']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {speed} | {fmt(r.get('loop_ms_per_step'), '.2f')} | "
            f"{fmt(r.get('generate_over_loop'), '.3f')} | {fmt(r.get('floor_ms'), '.2f')} | "
            f"{fmt(r.get('over_floor'), '.2f')} | {r['ttft_s']:.3f} | {ttft} | {fmt(r.get('peak_gb'), '.1f')} | "
            f"{fmt(r.get('compile_s'), '.1f')} | {r['recompiles']} | {'; '.join(notes)} |")
    return "\n".join(lines) + "\n"


def render(json_path: str) -> dict:
    return common.render_markdown(json_path, markdown)


def build(args, config):
    """(model, device, dtype, adapters by family) of one process, or of this rank under --tensor-parallel."""
    families = {("query" if parse_method(m).get("selection") == "query_head" else "kv")
                for m in args.method_list if not parse_method(m)["dense"]}
    if args.tensor_parallel:
        parallel.check_launch(config, args.device)
        accelerator = torch._C._get_accelerator().type
        dtype = getattr(torch, args.dtype or ("bfloat16" if accelerator == "cuda" else "float32"))
        model = parallel.build_model(config, dtype, args.tp_weights, args.seed)
        adapters = {family: parallel.rank_adapters(model, family, dtype, args.seed + 1) for family in families}
        return model, model.device, dtype, adapters
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    # Seeded: a --tensor-parallel run with seeded weights slices these weights and (on the CPU) these adapters.
    torch.manual_seed(args.seed)
    model = build_model(config, device, dtype)
    adapters = {}
    for family in sorted(families):
        torch.manual_seed(args.seed + 1)
        adapters[family] = build_adapters(config, family, device, dtype)
    return model, device, dtype, adapters


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    started = time.perf_counter()
    config = parallel.model_config(args, max(args.contexts) + args.new_tokens)
    model, device, dtype, adapters = build(args, config)
    model.generation_config.pad_token_id = 0
    rank, world = parallel.rank_and_world() if args.tensor_parallel else (0, 1)
    md_path, json_path = common.results_paths(BENCHMARK, common.device_kind(device), args.out)
    command = common.command_line("benchmarks.generate", argv)
    if args.tensor_parallel:
        command = command.replace("python -m", f"torchrun --nproc_per_node {world} -m", 1)
    meta = {**common.run_metadata(command, device),
            "model": parallel.model_label(args), "dtype": str(dtype).replace("torch.", ""),
            "sink": args.sink, "local": args.local, "sparse_prompt_tokens": args.sparse_prompt_tokens,
            "tensor_parallel": world, "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "rank_parameter_bytes": parallel.rank_parameter_bytes(model)}
    if args.tensor_parallel:
        meta["tp_weights"] = args.tp_weights
    bandwidth = copy_bandwidth(device)
    meta["copy_bandwidth_gb_per_s"] = bandwidth / 1e9 if bandwidth else None
    record = {"meta": meta, "new_tokens": args.new_tokens, "skip_tokens": args.skip_tokens, "rows": []}
    if args.merge and os.path.exists(json_path):
        with open(json_path) as f:
            record["rows"] = json.load(f)["rows"]
    key = lambda r: (r["n"], r["B"], r.get("tp", 1), r["cache"], r["method"])  # noqa: E731
    for n in args.contexts:
        for batch in args.batches:
            for cache in args.cache_list:
                for name in args.method_list:
                    over = time.perf_counter() - started > args.time_budget_s
                    if args.tensor_parallel:  # the ranks' clocks differ a little; all must skip or run the row
                        over = parallel.any_rank(over, device)
                    if over:
                        row = {"n": n, "B": batch, "tp": world, "cache": cache, "method": name,
                               "skipped": "time budget"}
                    else:
                        if rank == 0:
                            print(f"n={n} B={batch} tp={world} cache={cache} {name}", flush=True)
                        row = run_row(model, adapters, args, device, n, batch, cache, name, bandwidth)
                        if rank == 0:
                            print("   ", {k: v for k, v in row.items() if k not in ("tokens", "profile")}, flush=True)
                    record["rows"] = [r for r in record["rows"] if key(r) != key(row)] + [row]
                    if rank == 0:
                        common.write_results(md_path, json_path, markdown(record), record)
    if args.tensor_parallel:
        parallel.finish()
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
