"""End-to-end decode throughput: a Llama-3.1-8B-shaped model, dense vs HashAttention, StaticCache + CUDA graphs.

A model with the Llama-3.1-8B architecture (32 layers, hidden 4096, 32 query / 8 KV heads, head_dim
128, vocab 128256, llama3 RoPE) and random bf16 weights is built directly on the GPU (nothing is
downloaded; decode throughput does not depend on the weight values). For every context length n
and batch size B of the grid ("cell") it

1. fills one ``StaticCache`` of ``n + steps`` slots with n keys/values per sequence, once:
   ``--fill random`` writes Gaussian K/V with the standard deviation this random model's k_proj
   gives (``initializer_range * sqrt(hidden)``); ``--fill prefill`` runs a real chunked prefill of
   random tokens (``--prefill-chunk`` tokens per forward, ``logits_to_keep=1``) and times it;
2. encodes the key signatures of the n cached keys with the adapters' key MLPs (one buffer per
   adapter family: per-query-head keys for ``query_head`` selection, per-KV-head keys for
   ``kv_group``), timed: the prefill-time cost of HashAttention's signatures;
3. per method, compiles the decode step (``torch.compile(model.forward, mode="reduce-overhead",
   fullgraph=True)``), warms up (graph recording), rewinds the cache to n and times ``steps``
   greedy decode steps (argmax on the device fed back as a tensor; one synchronisation at the end).
   Every method decodes the same positions n .. n+steps-1 from the same cache and first token.

Methods: ``dense`` -- exact attention over the valid prefix through the fastest SDPA backend
that passes a float32 check on the real cache in this cell (``--dense-backend``; candidates:
``flash-varlen`` = FlashAttention-2 with per-sequence used lengths, attends exactly the written
keys; ``sdpa-cudnn`` / ``sdpa-efficient`` / ``sdpa-math`` = SDPA over the ``n + steps`` slots with the
boolean mask); ``dense-hf`` -- transformers' own ``sdpa`` path (repeats K/V for GQA under a mask;
for reference); ``hash-<selection>-<sparsity>`` -- ``hashattention.patch`` with random adapters
(``hash-query_head-32``, ``hash-kv_group-16``, ... ; ``hash-<selection>-full`` = budget of the
whole cache, which must reproduce dense's greedy tokens).

Attention share of a step: the attention of all layers, run alone on the cell's real cache (one
decode row per sequence at position n; dense: the chosen backend; HashAttention: query
signatures + ``hamming_topk`` + ``sparse_attention``, i.e. ``attention.select_and_attend``),
captured in one CUDA graph and timed by replay, divided by the measured step time.

What ran earlier in a process changes its CUDA-graph replays: any cuDNN call (the dense backend
checks, a cuDNN dense row) or a cold compile leaves ~0.3 ms more GPU idle time per B = 4 / 128K
step (H200: 8.86 against 8.57 ms, the same kernels). ``--process-per-method`` (with
``--warm-compile``) therefore times every method in a process of its own, as a user serving that
one model runs it (``benchmarks.decode_loop_processes``); every row records what ran before it in
its process.

Results go to ``benchmarks/results/decode_loop_<gpu>.json`` and ``.md`` (``--out`` picks another
folder), rewritten after every method (a run killed by a time limit still leaves them). A run
replaces the files of an earlier one; ``--merge`` adds its rows to them instead (what the processes
of ``--process-per-method`` do). Cells that do not fit in free GPU memory, or that would overrun
``--time-budget-s``, are recorded as skipped with the reason.

Layout: this module holds the arguments, the model, the cache fill and the grid loop;
``decode_loop_dense`` the dense backends and their float32 check, ``decode_loop_timing`` the timers
and the decode loop, ``decode_loop_profile`` the profiler breakdown, ``decode_loop_report`` the
JSON and Markdown results, ``decode_loop_processes`` the one-process-per-method runs.

    python -m benchmarks.decode_loop --contexts 131072 --batches 1,4
    python -m benchmarks.decode_loop --contexts 131072 --batches 4 --methods dense,hash-query_head-32 \\
        --process-per-method --warm-compile
    python -m benchmarks.decode_loop --tiny --device cpu --compile none --contexts 96 --batches 1,2 --steps 4 \\
        --sink 4 --local 4 --methods dense,hash-query_head-full,hash-query_head-32 --out /tmp/bg
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch

from benchmarks import common
from benchmarks.decode_loop_dense import (
    DENSE_ATTENTION_NAME,
    DENSE_CANDIDATES_CUDA,
    DENSE_STATE,
    check_dense_backends,
    register_dense_attention,
    sdpa_backend,
)
from benchmarks.decode_loop_profile import profile_decode
from benchmarks.decode_loop_report import (
    cell_key,
    comparable_key,
    environment,
    first_divergence,
    fmt,
    human_n,
    link_to_later_dense,
    load_previous,
    results_paths,
    write_results,
)
from benchmarks.decode_loop_timing import (
    Timer,
    compile_counters,
    decode,
    make_forward,
    paced_step_ms,
    rewind,
    time_replays,
)

DEFAULT_METHODS = "dense,hash-query_head-32,hash-query_head-16,hash-kv_group-32,hash-kv_group-16"


# ---- arguments and methods --------------------------------------------------------------------------

def int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None):
    # allow_abbrev=False: --process-per-method passes the arguments on to child processes by their full names.
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_loop",
                                     description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--contexts", type=int_list, default=[32768, 65536, 131072], help="n, comma-separated")
    parser.add_argument("--batches", type=int_list, default=[1, 4], help="B, comma-separated")
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps per method")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compile + CUDA-graph recording)")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma-separated: dense, dense-hf, hash-<query_head|kv_group>-<sparsity|full>")
    parser.add_argument("--compile", choices=("reduce-overhead", "cudagraphs", "eager", "none"),
                        default="reduce-overhead",
                        help="reduce-overhead: inductor + CUDA graphs; cudagraphs: CUDA graphs without inductor "
                             "(fast compile); eager: dynamo trace (fullgraph) run eagerly, any device (graph-break "
                             "check); none: plain eager (CPU smoke tests)")
    parser.add_argument("--fill", choices=("random", "prefill"), default="random",
                        help="random: Gaussian K/V written directly (seconds); prefill: a real chunked prefill of "
                             "random tokens (timed; ~B x n^2 attention work)")
    parser.add_argument("--prefill-chunk", type=int, default=4096, help="tokens per prefill forward")
    parser.add_argument("--dense-backend", default="auto", choices=("auto",) + DENSE_CANDIDATES_CUDA,
                        help="dense decode attention; auto = fastest candidate that passes the float32 check")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; tiny: 2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (CPU smoke tests)")
    parser.add_argument("--sink", type=int, default=128, help="HashAttention sink window (tokens)")
    parser.add_argument("--local", type=int, default=128, help="HashAttention local window (tokens)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--out", default=None,
                        help="folder of decode_loop_<gpu>.{json,md} (default: benchmarks/results)")
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="rewrite the Markdown table of a results file from its JSON, measuring nothing")
    parser.add_argument("--merge", action="store_true",
                        help="add this run's rows to the existing results files (a row of the same B, n and method "
                             "replaced) instead of replacing the files")
    parser.add_argument("--time-budget-s", type=float, default=540.0,
                        help="skip (and record) what would end after this many seconds from the start")
    parser.add_argument("--no-attention-share", action="store_true", help="skip the per-layer attention timing")
    parser.add_argument("--paced-steps", type=int, default=16,
                        help="extra decode steps (at most --steps) timed one at a time, each after the GPU went idle "
                             "(0: skip)")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="profile this many extra decode steps per method (GPU kernel time by category, "
                             "host-sync calls per step); 0 = off")
    parser.add_argument("--trace-dir", default=None,
                        help="also write each method's profiled steps as a Chrome trace (trace_B<b>_n<n>_<method>"
                             ".json.gz) into this folder and store where the GPU idles (tools.timeline_gaps)")
    parser.add_argument("--inductor-pdl", choices=("on", "off"), default="on",
                        help="inductor's Triton kernels launched with programmatic dependent launch (sm_90 and later; "
                             "sets torch._inductor.config.triton.enable_pdl for every method, over "
                             "TORCHINDUCTOR_ENABLE_PDL)")
    parser.add_argument("--inductor-option", action="append", metavar="KEY=VALUE",
                        help="set torch._inductor.config.KEY (dotted for nested options, e.g. combo_kernels=True or "
                             "triton.max_tiles=3) for every method; repeatable; 'none' alone: inductor's own defaults. "
                             "Without it: freezing=True and post_grad_custom_pre_pass='concat_projections_keep_layout' "
                             "under --compile reduce-overhead, nothing otherwise. Recorded per run "
                             "and row; a row takes its ratio only from a dense row with the same options. "
                             "post_grad_custom_pre_pass='concat_projections' (with freezing=True) merges the q / k / v "
                             "GEMMs of a layer into one (hashattention/inductor_passes.py); "
                             "'concat_projections_keep_layout' keeps the weights' column-major layout")
    parser.add_argument("--seed", type=int, default=0, help="K/V, prompt tokens and probe queries")
    parser.add_argument("--process-per-method", action="store_true",
                        help="time every method in a Python process of its own, merged into the same --out files "
                             "(benchmarks.decode_loop_processes says why)")
    parser.add_argument("--warm-compile", action="store_true",
                        help="with --process-per-method: first run each method once, untimed, in its own process, "
                             "so that the timed process compiles from a warm cache")
    args = parser.parse_args(argv)
    if args.warm_compile and not args.process_per_method:
        parser.error("--warm-compile needs --process-per-method")
    try:
        args.method_specs = [parse_method(name) for name in args.methods.split(",") if name.strip()]
    except ValueError as error:
        parser.error(str(error))
    if not args.method_specs:
        parser.error("--methods is empty")
    try:
        items = args.inductor_option
        if items is None:
            # Nothing said: the decode step's fastest measured settings (what
            # hashattention.compile_options.decode_compile_options() sets) wherever inductor compiles.
            items = list(DECODE_INDUCTOR_OPTIONS) if args.compile == "reduce-overhead" else []
        if [item.strip() for item in items] == ["none"]:
            items = []
        args.inductor_options = parse_inductor_options(items)
    except ValueError as error:
        parser.error(str(error))
    for name in ("steps", "warmup", "prefill-chunk"):
        if getattr(args, name.replace("-", "_")) < (1 if name != "warmup" else 0):
            parser.error(f"--{name} must be positive")
    return args


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    kind: str                        # "dense", "dense-hf" or "hash"
    selection: Optional[str] = None  # "query_head" or "kv_group"
    sparsity: Optional[float] = None  # None with full=True
    full: bool = False

    @property
    def family(self) -> Optional[str]:
        """Key-signature family: per-query-head keys for query_head selection, per-KV-head for kv_group."""
        return None if self.kind != "hash" else ("query" if self.selection == "query_head" else "kv")


def parse_method(name: str) -> Method:
    name = name.strip()
    if name in ("dense", "dense-hf"):
        return Method(name, name)
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "hash" and parts[1] in ("query_head", "kv_group"):
        if parts[2] == "full":
            return Method(name, "hash", parts[1], None, True)
        try:
            sparsity = float(parts[2])
        except ValueError:
            sparsity = None
        if sparsity is not None and sparsity > 1:
            return Method(name, "hash", parts[1], sparsity)
    raise ValueError(
        f"--methods: unknown method {name!r}; expected dense, dense-hf or hash-<query_head|kv_group>-<sparsity > 1|full>"
    )


# ---- model --------------------------------------------------------------------------------------------

def model_config(args, max_positions: int):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if args.tiny:
        shape = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers or 2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    else:  # Llama-3.1-8B
        shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers or 32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    return LlamaConfig(**shape, rms_norm_eps=1e-5, rope_parameters=rope, initializer_range=0.02,
                       max_position_embeddings=max(131072, max_positions), tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=None, pad_token_id=None)


def build_model(config, device, dtype):
    """Random weights created directly on ``device`` in ``dtype`` (no float32 copy on the host)."""
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)  # post_init draws N(0, 0.02) weights on the device
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    wrong = {str(p.dtype) for p in model.parameters() if p.dtype != dtype}
    if wrong:
        raise RuntimeError(f"model parameters were created in {wrong}, expected {dtype}")
    return model


def build_adapters(config, family: str, device, dtype):
    from hashattention import HashAdapters

    with torch.device(device):
        adapters = HashAdapters.for_model_config(config, key_heads=family)
    return adapters.to(dtype=dtype).eval().requires_grad_(False)


# ---- memory -------------------------------------------------------------------------------------------

def cell_bytes(config, batch: int, slots: int, element: int, families, args) -> Dict[str, int]:
    """What a cell allocates beyond the model: K/V, signature buffers and a workspace allowance."""
    layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    heads = config.num_attention_heads
    kv = 2 * batch * layers * kv_heads * slots * head_dim * element
    signatures = {f: batch * layers * (heads if f == "query" else kv_heads) * slots * 4 for f in families}
    encode_chunk = 8192
    workspace = batch * heads * encode_chunk * 128 * 4 * 4                       # signature encoding (float32)
    workspace += batch * heads * slots * 4 * 2                                   # float32 reference of the check
    if args.fill == "prefill":
        rows = batch * args.prefill_chunk
        workspace += rows * (3 * config.intermediate_size + 8 * config.hidden_size) * element
        workspace += batch * args.prefill_chunk * slots * 3                      # boolean mask (+ float bias)
    if any(m.kind == "dense-hf" for m in args.method_specs):
        workspace += 2 * batch * heads * slots * head_dim * element * 2          # repeat_kv of K and V
    if args.inductor_options.get("freezing"):
        # freezing concatenates the q / k / v and gate / up weights into new constants; the
        # module keeps its own parameters, so those bytes exist twice
        hidden, inter = config.hidden_size, config.intermediate_size
        workspace += layers * hidden * ((heads + 2 * kv_heads) * head_dim + 2 * inter) * element
    workspace += 2 << 30                                                         # graphs, logits, allocator slack
    return {"kv": kv, "signatures": signatures, "workspace": workspace,
            "total": kv + sum(signatures.values()) + workspace}


def free_bytes(device) -> Optional[int]:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def release(device):
    import torch._dynamo

    torch._dynamo.reset()
    try:  # CUDA-graph trees keep their memory pools until reset
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except Exception:
        pass
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- cache fill and signatures ------------------------------------------------------------------------

def new_static_cache(model, batch: int, slots: int, device, dtype):
    """A StaticCache whose layers are allocated now (zeros) and marked static."""
    from transformers import StaticCache

    config = model.config
    cache = StaticCache(config=config, max_cache_len=slots)
    dummy = torch.zeros(batch, config.num_key_value_heads, 1, config.head_dim, device=device, dtype=dtype)
    for layer in cache.layers:
        layer.lazy_initialization(dummy, dummy)
    return cache


def fill_random(cache, valid: int, std: float, seed: int):
    g = torch.Generator(device=cache.layers[0].keys.device).manual_seed(seed)
    for layer in cache.layers:
        for buffer in (layer.keys, layer.values):
            part = buffer[:, :, :valid]
            part.normal_(0.0, std, generator=g)
        layer.cumulative_length.fill_(valid)


def fill_prefill(model, cache, batch: int, valid: int, chunk: int, device, seed: int):
    """Chunked prefill of random tokens; returns (seconds, first decode token (B, 1))."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, valid), generator=g, device=device)
    slots = cache.layers[0].keys.shape[2]
    full_mask = torch.ones(batch, slots, dtype=torch.long, device=device)
    with Timer(device) as t:
        for start in range(0, valid, chunk):
            end = min(valid, start + chunk)
            positions = torch.arange(start, end, device=device)[None].expand(batch, -1)
            out = model(input_ids=ids[:, start:end], attention_mask=full_mask, position_ids=positions,
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            del out
    return t.seconds, token


def attach_signatures(model, base_cache, adapters, valid: int, device, chunk: int = 8192):
    """A cache of SignatureStaticLayers sharing ``base_cache``'s K/V and lengths, with the first ``valid`` keys encoded.

    What ``hashattention.cache.to_signature_layer`` does for a static layer, but encoding in chunks of
    ``chunk`` keys (bounded float32 workspace) and only the written keys. Returns (cache, encode seconds).
    """
    from transformers import StaticCache

    from hashattention.cache import SignatureStaticLayer, aligned_signature_buffer

    base = base_cache.layers[0]
    cache = StaticCache(config=model.config, max_cache_len=base.max_cache_len)
    layers = []
    for index, source in enumerate(base_cache.layers):
        layer = SignatureStaticLayer(source.max_cache_len, adapters[index])
        for name in ("dtype", "device", "batch_size", "num_heads", "k_head_dim", "v_head_dim"):
            setattr(layer, name, getattr(source, name))
        layer.keys, layer.values, layer.cumulative_length = source.keys, source.values, source.cumulative_length
        # The library's layout (rows padded to 16-byte alignment): with an unaligned buffer the
        # selection falls back to its two-launch path and the benchmark would not measure what
        # users run.
        layer.key_signatures = aligned_signature_buffer(
            source.batch_size, adapters.config.num_key_signature_heads, source.max_cache_len, adapters.config.words,
            device)
        torch._dynamo.mark_static_address(layer.key_signatures)
        layer.allocate_decode_buffers(source.batch_size, device)  # as lazy_initialization does
        layer.is_initialized = True
        layers.append(layer)
    with Timer(device) as t:
        for index, layer in enumerate(layers):
            for start in range(0, valid, chunk):
                end = min(valid, start + chunk)
                layer.key_signatures[:, :, start:end] = adapters[index].key_signatures(
                    layer.keys[:, :, start:end].contiguous())
    cache.layers = layers
    return cache, t.seconds


# ---- one method ---------------------------------------------------------------------------------------

def hash_config(method: Method, args, slots: int):
    from hashattention.config import HashAttentionConfig

    common = dict(sink_tokens=args.sink, local_tokens=args.local, selection=method.selection, sparse_prompt_tokens=0)
    if method.full:
        return HashAttentionConfig(budget_tokens=max(slots, args.sink + args.local), **common)
    return HashAttentionConfig(sparsity=method.sparsity, **common)


def run_method(model, cache, first_token, valid: int, args, device, trace_path: Optional[str] = None):
    """Compile, warm up, rewind and time ``args.steps`` decode steps. Returns the measurements."""
    from torch._dynamo.utils import counters

    slots = cache.layers[0].keys.shape[2]
    batch = first_token.shape[0]
    full_mask = torch.ones(batch, slots, dtype=torch.long, device=device)
    torch._dynamo.reset()
    counters.clear()
    forward = make_forward(model, args.compile)
    mark = args.compile in ("reduce-overhead", "cudagraphs")
    result = {}
    with torch.no_grad():
        rewind(cache, valid)
        warm_times = []
        for step in range(args.warmup):
            with Timer(device) as t:
                decode(forward, cache, first_token, valid + step, 1, full_mask, device, mark)
            warm_times.append(t.seconds)
            if step == 0:
                print(f"    first call (compile + run): {warm_times[0]:.1f} s", flush=True)
        result["compile_s"] = warm_times[0] if warm_times else None
        result["warmup_s"] = warm_times
        rewind(cache, valid)
        with Timer(device) as t:
            tokens = decode(forward, cache, first_token, valid, args.steps, full_mask, device, mark)
        result.update(compile_counters())
        if args.paced_steps > 0:
            rewind(cache, valid)
            # at most `steps` of them: the positions of the timed steps, which the cache has slots for
            result["paced_ms_per_step"] = paced_step_ms(forward, cache, first_token, valid,
                                                        min(args.paced_steps, args.steps), full_mask, device, mark)
        if args.profile_steps > 0:
            try:
                result["profile"] = profile_decode(forward, cache, first_token, valid, args.profile_steps, full_mask,
                                                   device, mark, trace_path=trace_path)
            except Exception as error:  # the profile is extra evidence; never lose the timing for it
                result["profile"] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    result["decode_s"] = t.seconds
    result["ms_per_step"] = 1e3 * t.seconds / args.steps
    result["host_ms_per_step"] = 1e3 * t.host_seconds / args.steps
    result["tokens_per_s"] = batch * args.steps / t.seconds
    result["generated_tokens"] = tokens.cpu().tolist()
    del forward
    return result


def hash_attention_per_step(model, cache, adapters, config, valid: int, device, dtype):
    """Seconds of all layers' HashAttention decode attention (encode query + select + attend), alone."""
    from hashattention.attention import LayerRuntime, select_and_attend

    mconf = model.config
    batch = cache.layers[0].keys.shape[0]
    selection_heads = mconf.num_attention_heads if config.selection == "query_head" else mconf.num_key_value_heads
    runtimes = [LayerRuntime(adapter=adapters[i], config=config, selection_heads=selection_heads)
                for i in range(len(cache.layers))]
    g = torch.Generator(device=device).manual_seed(7)
    query = torch.randn(batch, mconf.num_attention_heads, 1, mconf.head_dim, generator=g, device=device,
                        dtype=dtype) * 1.3
    starts = torch.zeros(batch, dtype=torch.int32, device=device)
    lengths = torch.full((batch,), valid, dtype=torch.int32, device=device)
    scale = mconf.head_dim ** -0.5

    def all_layers():
        for runtime, layer in zip(runtimes, cache.layers):
            select_and_attend(runtime, query, layer.keys, layer.values, layer.key_signatures, lengths, starts, scale)

    return time_replays(all_layers, device)


# ---- main loop ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Cell:
    """One (B, n) of the grid: its caches (shared by all methods) and what the dense check found."""

    batch: int
    n: int
    slots: int
    base: object = None                                       # StaticCache with the K/V
    caches: Dict[str, object] = dataclasses.field(default_factory=dict)  # family -> cache with signatures
    first_token: Optional[torch.Tensor] = None
    dense_checks: List[dict] = dataclasses.field(default_factory=list)
    dense_order: List[str] = dataclasses.field(default_factory=list)  # passing backends, fastest first
    dense_tokens_per_s: Optional[float] = None
    dense_tokens: Optional[list] = None


def apply_inductor_pdl(enabled: bool) -> None:
    """Sets inductor's programmatic dependent launch for the Triton kernels it generates from now on.

    On: each generated kernel waits for the grid before it (``griddepcontrol.wait``) before it touches that
    grid's outputs and lets the next one be placed after its loads, so on sm_90 and later consecutive graph
    nodes overlap their launch and prologue. HashAttention's CUDA kernels already wait for the grids before
    them before their first read, so they may follow such a kernel early. Inductor ignores it below sm_90.
    H200, B = 4 / 128K / 32x per query head: 8.63 -> 8.49 ms per step, dense 21.23 -> 21.13.
    """
    import torch._inductor.config as inductor_config

    inductor_config.triton.enable_pdl = enabled


def parse_inductor_options(items: List[str]) -> Dict[str, object]:
    """``["KEY=VALUE", ...]`` -> {KEY: value}: KEY names an existing torch._inductor.config option (dotted for
    nested ones), VALUE a Python literal (True, 8, 0.5, 'name'). Raises ValueError naming a bad item."""
    import ast

    options: Dict[str, object] = {}
    for item in items:
        key, sep, text = item.strip().partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--inductor-option: expected KEY=VALUE, got {item!r}")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--inductor-option {key}: VALUE must be a Python literal (True, 8, 'x'), got {text!r}")
        if key == "triton.enable_pdl":  # rows record it as inductor_pdl; two switches could disagree
            raise ValueError("--inductor-option triton.enable_pdl: use --inductor-pdl on|off")
        owner, name = inductor_config_owner(key)
        current = getattr(owner, name)
        if current is not None and not isinstance(value, type(current)) and not (
                isinstance(current, float) and isinstance(value, int)):
            raise ValueError(f"--inductor-option {key}: expected a {type(current).__name__} like its default "
                             f"{current!r}, got {value!r}")
        if key == GRAPH_PASS_OPTION and value not in GRAPH_PASSES:
            names = ", ".join(repr(name) for name in GRAPH_PASSES)
            raise ValueError(f"--inductor-option {key}: name one of this package's passes ({names}), got {value!r}")
        options[key] = value
    if GRAPH_PASS_OPTION in options and not options.get("freezing"):
        raise ValueError(f"--inductor-option post_grad_custom_pre_pass={options[GRAPH_PASS_OPTION]!r} needs freezing=True "
                         "(without it the weights are graph inputs, not constants, and nothing is merged)")
    return options


def inductor_config_owner(key: str):
    """(config object, attribute name) of torch._inductor.config's dotted ``key``; ValueError if it has none."""
    import torch._inductor.config as inductor_config

    *path, name = key.split(".")
    owner = inductor_config
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            break
    if owner is None or not hasattr(owner, name) or callable(getattr(owner, name)):
        raise ValueError(f"--inductor-option: torch._inductor.config has no option {key!r}")
    return owner, name


def apply_inductor_options(options: Dict[str, object]) -> None:
    """Sets torch._inductor.config options for every graph compiled from now on (this process)."""
    for key, value in options.items():
        owner, name = inductor_config_owner(key)
        if key == GRAPH_PASS_OPTION:  # rows record the pass by name; inductor needs the pass object
            from hashattention.inductor_passes import ConcatProjections

            value = ConcatProjections(layout=GRAPH_PASSES[value])
        setattr(owner, name, value)


# The default --inductor-option list for --compile reduce-overhead, by name, as rows record it: what
# hashattention.compile_options.decode_compile_options() sets besides CUDA graphs and PDL (frozen weights,
# q | k | v and gate | up merged into one GEMM each, column-major). H200, B = 4, 128K, 32x per head:
# 8.49 -> 7.97 ms per step, dense 21.13 -> 20.12 (benchmarks/results/decode_loop_h200.md).
DECODE_INDUCTOR_OPTIONS = ("freezing=True", "post_grad_custom_pre_pass='concat_projections_keep_layout'")

# The inductor option that may name this package's graph pass (hashattention/inductor_passes.py), and
# its names: the pass with each layout of the concatenated weights
GRAPH_PASS_OPTION = "post_grad_custom_pre_pass"
GRAPH_PASSES = {"concat_projections": "row_major", "concat_projections_keep_layout": "keep"}


class Benchmark:
    """The grid loop: builds the model once, then fills, measures and records cell after cell."""

    def __init__(self, args, argv):
        self.args = args
        self.started = time.monotonic()
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        self.element = torch.finfo(self.dtype).bits // 8
        if args.compile in ("reduce-overhead", "cudagraphs") and self.device.type != "cuda":
            raise SystemExit(f"--compile {args.compile} needs a CUDA device; use --compile none or eager on the CPU")
        if self.device.type == "cuda" and any(m.kind == "hash" for m in args.method_specs):
            import hashattention

            if not hashattention.WITH_CUDA:
                raise SystemExit("the hashattention extension was built without CUDA kernels: rebuild it on the GPU "
                                 "machine (make build) before benchmarking HashAttention on CUDA")
        apply_inductor_pdl(args.inductor_pdl == "on")
        apply_inductor_options(args.inductor_options)
        torch.manual_seed(args.seed)
        register_dense_attention()

        self.md_path, self.json_path = results_paths(args.out, self.device)
        self.record = load_previous(self.json_path) if args.merge else {}
        for key in ("rows", "fills", "runs", "dense_checks"):
            self.record.setdefault(key, [])
        self.record["env"] = environment(self.device)
        command = common.command_line("benchmarks.decode_loop", argv)
        print(f"{command}\n{self.record['env']}", flush=True)

        self.config = model_config(args, max(args.contexts) + args.steps + args.warmup + 8)
        with Timer(self.device) as t:
            self.model = build_model(self.config, self.device, self.dtype)
        c = self.config
        described = (f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads}/"
                     f"{c.num_key_value_heads} heads, head_dim {c.head_dim}, vocab {c.vocab_size}, {self.dtype}")
        print(f"model built in {t.seconds:.1f} s: {described}", flush=True)
        self.record["runs"].append({
            "command": command, "started_utc": common.utc_now(), "fill": args.fill,
            "compile": args.compile, "inductor_pdl": args.inductor_pdl == "on",
            "inductor_options": dict(args.inductor_options), "model": described,
            "steps": args.steps, "warmup": args.warmup,
            "sink": args.sink, "local": args.local, "model_build_s": t.seconds,
            "environment": common.measured_environment()})
        self.families = sorted({m.family for m in args.method_specs if m.family})
        self.adapters = {f: build_adapters(c, f, self.device, self.dtype) for f in self.families}
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # What this random model's k_proj gives for RMS-normalised inputs: std 0.02 * sqrt(hidden).
        self.key_std = c.initializer_range * math.sqrt(c.hidden_size)
        self.order = {m.name: i for i, m in enumerate(args.method_specs)}
        # GPU work this process did before each method (dense backend checks, earlier methods): a B = 4 step
        # was measured ~0.3 ms faster where a warm-cached compile was a process's first GPU work (the same
        # kernels, ~90 instead of ~440 µs of idle time between graph nodes), so every row says what ran before it.
        self.ran_before: List[str] = []
        # Whether this process has used cuDNN (a dense check or row through sdpa-cudnn): that alone slows
        # later CUDA-graph replays, so every row records it.
        self.cudnn_used = False
        self.method_seconds: List[float] = []
        self.fill_rate = 0.0  # seconds per (token x sequence) of fill + encode + check, from the previous cell

    # -- bookkeeping --

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save(self, row=None, fill=None, check=None) -> None:
        r = self.record
        if row is not None:
            r["rows"] = [x for x in r["rows"] if cell_key(x) != cell_key(row)] + [row]
            if row["method"] == "dense" and row["status"] == "ok":
                link_to_later_dense(r["rows"], row)
        if fill is not None:
            r["fills"] = [x for x in r["fills"] if (x["B"], x["n"]) != (fill["B"], fill["n"])] + [fill]
        if check is not None:
            r["dense_checks"] = [x for x in r["dense_checks"] if (x["B"], x["n"]) != (check["B"], check["n"])]
            r["dense_checks"].append(check)
        r["updated_utc"] = common.utc_now()
        write_results(r, self.json_path, self.md_path)

    def base_row(self, batch: int, n: int, method: Method) -> dict:
        a = self.args
        return {"B": batch, "n": n, "method": method.name, "order": self.order[method.name], "fill": a.fill,
                "compile": a.compile, "inductor_pdl": a.inductor_pdl == "on",
                "inductor_options": dict(a.inductor_options), "steps": a.steps,
                "ran_before_in_process": list(self.ran_before),
                "cudnn_before_in_process": self.cudnn_used}

    def note_backends_run(self, checks) -> None:
        """Records whether any of these dense checks ran cuDNN."""
        self.cudnn_used |= any(c["backend"] == "sdpa-cudnn" for c in checks)

    def skip_cell(self, batch: int, n: int, reason: str) -> None:
        print(f"[B={batch} n={n}] skipped: {reason}", flush=True)
        for method in self.args.method_specs:
            self.save(row={**self.base_row(batch, n, method), "status": "skipped", "reason": reason})

    # -- the grid --

    def run(self) -> dict:
        if self.args.fill == "prefill":
            self.choose_prefill_backend()
        for n in self.args.contexts:
            for batch in self.args.batches:
                self.run_cell(batch, n)
        print(f"done in {self.elapsed():.0f} s: {self.json_path}, {self.md_path}", flush=True)
        return self.record

    def choose_prefill_backend(self) -> None:
        """Prefill needs a multi-row dense backend: check the candidates once on a small cache of the model's shapes."""
        probe = new_static_cache(self.model, 1, 1024, self.device, self.dtype)
        fill_random(probe, 1024, self.key_std, self.args.seed)
        candidates = DENSE_CANDIDATES_CUDA if self.device.type == "cuda" else ("sdpa-math",)
        checks = check_dense_backends(probe, self.config, 1000, self.device, self.dtype, candidates, rows=16,
                                      time_it=False, first_passing=True)
        self.note_backends_run(checks)
        DENSE_STATE["prefill"] = next((c["backend"] for c in checks if c["ok"]), "sdpa-math")
        print(f"prefill attention backend: {DENSE_STATE['prefill']}", flush=True)

    def run_cell(self, batch: int, n: int) -> None:
        args = self.args
        slots = n + args.steps + args.warmup
        need = cell_bytes(self.config, batch, slots, self.element, self.families, args)
        free = free_bytes(self.device)
        if free is not None and need["total"] > free:
            return self.skip_cell(batch, n, (
                f"needs ~{need['total'] / 2**30:.1f} GiB (KV {need['kv'] / 2**30:.1f}, signatures "
                f"{sum(need['signatures'].values()) / 2**30:.1f}, workspace {need['workspace'] / 2**30:.1f}) beyond "
                f"the {self.weights_bytes / 2**30:.1f} GiB of weights; {free / 2**30:.1f} GiB free"))
        predicted = self.fill_rate * n * batch + (max(self.method_seconds) if self.method_seconds else 0.0)
        if self.elapsed() + predicted > args.time_budget_s:
            return self.skip_cell(batch, n, f"time budget: {self.elapsed():.0f} s elapsed + ~{predicted:.0f} s "
                                            f"predicted > {args.time_budget_s:.0f} s")
        print(f"[B={batch} n={n}] {slots} cache slots, KV {need['kv'] / 1e9:.1f} GB, "
              f"elapsed {self.elapsed():.0f} s", flush=True)
        cell = Cell(batch, n, slots)
        try:
            start = time.monotonic()
            with torch.no_grad():
                self.prepare(cell)
            self.fill_rate = (time.monotonic() - start) / (n * batch)
        except Exception as error:
            import traceback

            traceback.print_exc()
            cell = None
            release(self.device)
            return self.skip_cell(batch, n, f"cache fill failed: {type(error).__name__}: {str(error)[:300]}")
        for method in args.method_specs:
            self.measure(cell, method)
        cell = None
        release(self.device)

    def prepare(self, cell: Cell) -> None:
        """Fill the cache once, encode the key signatures per family, check and time the dense backends."""
        args, device, dtype = self.args, self.device, self.dtype
        fill = {"B": cell.batch, "n": cell.n, "fill": args.fill, "encode_s": {}}
        cell.base = new_static_cache(self.model, cell.batch, cell.slots, device, dtype)
        seed = args.seed + cell.n + cell.batch
        if args.fill == "random":
            with Timer(device) as t:
                fill_random(cell.base, cell.n, self.key_std, seed)
            fill.update(fill_s=t.seconds, key_std=self.key_std)
            cell.first_token = torch.ones(cell.batch, 1, dtype=torch.long, device=device)
        else:
            self.model.set_attn_implementation(DENSE_ATTENTION_NAME)
            with sdpa_backend(DENSE_STATE["prefill"], device):
                seconds, cell.first_token = fill_prefill(self.model, cell.base, cell.batch, cell.n,
                                                         args.prefill_chunk, device, seed)
            fill.update(fill_s=seconds, prefill_s=seconds, prefill_attention_backend=DENSE_STATE["prefill"],
                        prefill_chunk=args.prefill_chunk)
        for family in self.families:
            cell.caches[family], fill["encode_s"][family] = attach_signatures(
                self.model, cell.base, self.adapters[family], cell.n, device)
        print(f"    fill {fill['fill_s']:.2f} s ({args.fill}), signature encode "
              + ", ".join(f"{f} {s:.3f} s" for f, s in fill["encode_s"].items()), flush=True)
        self.save(fill=fill)
        if any(m.kind == "dense" for m in args.method_specs):
            if device.type != "cuda":
                candidates = ("sdpa-math",)
            elif args.dense_backend != "auto":
                candidates = (args.dense_backend,)
            else:
                candidates = DENSE_CANDIDATES_CUDA
            time_it = not args.no_attention_share or len(candidates) > 1
            cell.dense_checks = check_dense_backends(cell.base, self.config, cell.n, device, dtype, candidates,
                                                     time_it=time_it)
            self.ran_before.append(f"dense checks B={cell.batch} n={human_n(cell.n)}")
            self.note_backends_run(cell.dense_checks)
            passing = sorted((c for c in cell.dense_checks if c["ok"]), key=lambda c: c.get("attention_s_per_step", 0))
            cell.dense_order = [c["backend"] for c in passing]
            self.save(check={"B": cell.batch, "n": cell.n, "checks": cell.dense_checks})

    def measure(self, cell: Cell, method: Method) -> None:
        """Time one method on the cell's cache and record the row (ok, skipped or error)."""
        from hashattention.patching import is_patched, unpatch

        args, config = self.args, self.config
        row = self.base_row(cell.batch, cell.n, method)
        predicted = max(self.method_seconds) if self.method_seconds else 0.0
        if self.elapsed() + predicted > args.time_budget_s:
            row.update(status="skipped", reason=f"time budget: {self.elapsed():.0f} s elapsed + ~{predicted:.0f} s "
                                                f"predicted > {args.time_budget_s:.0f} s")
            print(f"  {method.name}: {row['reason']}", flush=True)
            return self.save(row=row)
        print(f"  {method.name} (B={cell.batch} n={cell.n})", flush=True)
        start = time.monotonic()
        row["kv_bytes"] = 2 * cell.batch * config.num_hidden_layers * config.num_key_value_heads * cell.n \
            * config.head_dim * self.element
        row["signature_bytes"] = 0
        try:
            if method.kind == "dense":
                result = self.measure_dense(cell, method, row)
            elif method.kind == "dense-hf":
                self.model.set_attn_implementation("sdpa")
                result = run_method(self.model, cell.base, cell.first_token, cell.n, args, self.device,
                                    self.trace_path(cell, method))
            else:
                result = self.measure_hash(cell, method, row)
            row.update(result, status="ok")
            if row.get("attention_s_per_step") is not None:
                row["attention_share"] = row["attention_s_per_step"] * 1e3 / row["ms_per_step"]
            if method.kind == "dense":
                cell.dense_tokens_per_s, cell.dense_tokens = row["tokens_per_s"], row["generated_tokens"]
            elif cell.dense_tokens_per_s is None:
                self.dense_from_earlier_run(cell, row)
            if method.kind != "dense" and cell.dense_tokens_per_s:
                row["ratio_to_dense"] = row["tokens_per_s"] / cell.dense_tokens_per_s
                row["first_divergence_from_dense"] = first_divergence(row["generated_tokens"], cell.dense_tokens)
            print(f"    {row['tokens_per_s']:.1f} tokens/s, {row['ms_per_step']:.2f} ms/step"
                  + (f" (host issued {row['host_ms_per_step']:.2f})" if row.get("host_ms_per_step") else "")
                  + (f", {row['paced_ms_per_step']:.2f} ms a step alone" if row.get("paced_ms_per_step") else "")
                  + (f", {row['ratio_to_dense']:.2f}x dense" if row.get("ratio_to_dense") else "")
                  + (f", attention {100 * row['attention_share']:.0f}%" if row.get("attention_share") else "")
                  + f", compile {fmt(row.get('compile_s'), '.1f')} s, graph breaks {row['graph_breaks']}, "
                    f"cudagraph skips {row['cudagraph_skips']}", flush=True)
        except Exception as error:
            import traceback

            traceback.print_exc()
            row.update(status="error", reason=f"{type(error).__name__}: {str(error)[:300]}")
        finally:
            if is_patched(self.model):
                unpatch(self.model)
            self.model.set_attn_implementation(DENSE_ATTENTION_NAME)
            self.method_seconds.append(time.monotonic() - start)
            row["method_wall_s"] = self.method_seconds[-1]
            self.ran_before.append(f"{method.name} B={cell.batch} n={human_n(cell.n)}")
            self.save(row=row)
            release(self.device)

    def trace_path(self, cell: Cell, method: Method) -> Optional[str]:
        if not self.args.trace_dir:
            return None
        return os.path.join(self.args.trace_dir, f"trace_B{cell.batch}_n{cell.n}_{method.name}.json.gz")

    def dense_from_earlier_run(self, cell: Cell, row: dict) -> None:
        """Without dense in this run, compare with a dense row already in the results (--merge) on the same cell
        setup."""
        earlier = next((r for r in self.record["rows"] if r["status"] == "ok" and r["method"] == "dense"
                        and comparable_key(r) == comparable_key(row)), None)
        if earlier is not None:
            cell.dense_tokens_per_s, cell.dense_tokens = earlier["tokens_per_s"], earlier["generated_tokens"]
            row["dense_from_earlier_run"] = True

    def measure_dense(self, cell: Cell, method: Method, row: dict) -> dict:
        """The fastest verified backend; if it fails under compilation, the next one (the failure is recorded)."""
        if not cell.dense_order:
            raise RuntimeError("no dense backend passed the float32 check: " + json.dumps(cell.dense_checks)[:400])
        self.model.set_attn_implementation(DENSE_ATTENTION_NAME)
        failures = []
        for backend in cell.dense_order:
            DENSE_STATE["decode"] = backend
            try:
                with sdpa_backend(backend, self.device):
                    result = run_method(self.model, cell.base, cell.first_token, cell.n, self.args, self.device,
                                        self.trace_path(cell, method))
            except Exception as error:
                if backend == cell.dense_order[-1]:
                    raise
                failures.append(f"{backend}: {type(error).__name__}: {str(error)[:200]}")
                print(f"    dense backend {backend} failed ({failures[-1]}); trying the next", flush=True)
                release(self.device)
                continue
            check = next(c for c in cell.dense_checks if c["backend"] == backend)
            row.update(dense_backend=backend, attention_s_per_step=check.get("attention_s_per_step"))
            if failures:
                row["failed_backends"] = failures
            return result
        raise AssertionError("unreachable")

    def measure_hash(self, cell: Cell, method: Method, row: dict) -> dict:
        from hashattention.patching import patch

        adapters = self.adapters[method.family]
        hconfig = hash_config(method, self.args, cell.slots)
        cache = cell.caches[method.family]
        row["hash_config"] = hconfig.describe()
        row["signature_bytes"] = cell.batch * self.config.num_hidden_layers * adapters.config.num_key_signature_heads \
            * cell.n * 4 * adapters.config.words
        with patch(self.model, adapters, hconfig):
            result = run_method(self.model, cache, cell.first_token, cell.n, self.args, self.device,
                                self.trace_path(cell, method))
        if not self.args.no_attention_share:
            rewind(cache, cell.n)
            with torch.no_grad():
                row["attention_s_per_step"] = hash_attention_per_step(self.model, cache, adapters, hconfig, cell.n,
                                                                      self.device, self.dtype)
        return result


def render(json_path: str) -> dict:
    """Rewrite ``<name>.md`` beside ``json_path`` from the rows recorded in it."""
    record = load_previous(json_path)
    if not record.get("rows"):
        raise SystemExit(f"{json_path}: no rows to render")
    write_results(record, json_path, os.path.splitext(json_path)[0] + ".md")
    print(f"wrote {os.path.splitext(json_path)[0]}.md", flush=True)
    return record


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    if args.process_per_method:
        from benchmarks.decode_loop_processes import run_in_processes

        failures = run_in_processes(args, sys.argv[1:] if argv is None else list(argv))
        _, json_path = results_paths(args.out, torch.device(args.device or ("cuda" if torch.cuda.is_available()
                                                                              else "cpu")))
        print(f"process per method: {failures} failed; results in {json_path}", flush=True)
        return load_previous(json_path)
    return Benchmark(args, argv).run()


if __name__ == "__main__":
    main()
