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

Results go to ``<out>/bench_generate_<YYYYMMDD>.json`` and ``.md``, rewritten after every method
(a run killed by a time limit still leaves them); rows of an earlier run of the same day are kept
unless re-measured (``--fresh`` starts over). Cells that do not fit in free GPU memory, or that
would overrun ``--time-budget-s``, are recorded as skipped with the reason.

    python scripts/bench_generate.py --contexts 131072 --batches 1,4 --out benchmarks/results
    python scripts/bench_generate.py --tiny --device cpu --compile none --contexts 96 --batches 1,2 --steps 4 \\
        --sink 4 --local 4 --methods dense,hash-query_head-full,hash-query_head-32 --out /tmp/bg
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402

DEFAULT_METHODS = "dense,hash-query_head-32,hash-query_head-16,hash-kv_group-32,hash-kv_group-16"
DENSE_ATTENTION_NAME = "bench_dense"
DENSE_CANDIDATES_CUDA = ("flash-varlen", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
SDPA_FLAGS = {  # backend -> (flash, mem_efficient, math, cudnn) enabled
    "sdpa-cudnn": (False, False, False, True),
    "sdpa-efficient": (False, True, False, False),
    "sdpa-math": (False, False, True, False),
}
TARGETS = ((1, 131072, "hash-query_head-32", 1.7), (4, 131072, "hash-query_head-32", 2.5))


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    parser.add_argument("--out", default="benchmarks/results",
                        help="folder of bench_generate_<YYYYMMDD>.{json,md} (merged with an earlier run of the day)")
    parser.add_argument("--fresh", action="store_true", help="do not keep rows of an earlier run of the same day")
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
                             ".json.gz) into this folder and store where the GPU idles (scripts/timeline_gaps.py)")
    parser.add_argument("--seed", type=int, default=0, help="K/V, prompt tokens and probe queries")
    args = parser.parse_args(argv)
    try:
        args.method_specs = [parse_method(name) for name in args.methods.split(",") if name.strip()]
    except ValueError as error:
        parser.error(str(error))
    if not args.method_specs:
        parser.error("--methods is empty")
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


# ---- timing -------------------------------------------------------------------------------------------

class Timer:
    """Elapsed seconds of a region: CUDA events (one sync at the end) on GPU, perf_counter on CPU.

    ``host_seconds`` is the host's time to issue the region (perf_counter up to the final sync): when
    it is close to ``seconds``, the GPU waited for the host (Python, guards, graph-replay
    bookkeeping), and faster kernels would not show.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc):
        self.host_seconds = time.perf_counter() - self.t0
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def time_replays(fn, device, repeats: int = 10) -> float:
    """Seconds per call of ``fn`` (a whole decode step's attention): CUDA-graph replays, eager if capture fails."""
    if device.type != "cuda":
        fn()
        with Timer(device) as t:
            for _ in range(repeats):
                fn()
        return t.seconds / repeats
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on a side stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # a backend that cannot be captured is timed by eager launches
        torch.cuda.synchronize()
        run = fn
    run()
    with Timer(device) as t:
        for _ in range(repeats):
            run()
    del run
    return t.seconds / repeats


# ---- dense attention (valid prefix, verified backend) ------------------------------------------------

DENSE_STATE = {"decode": "sdpa-math", "prefill": "sdpa-math"}


@contextlib.contextmanager
def sdpa_backend(name: str, device):
    """Enable only ``name``'s SDPA backend (the choice is made when the graph is traced, so it spans the run)."""
    if device.type != "cuda" or name not in SDPA_FLAGS:
        yield
        return
    b = torch.backends.cuda
    saved = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())
    flags = SDPA_FLAGS[name]
    for setter, on in zip((b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp, b.enable_cudnn_sdp), flags):
        setter(on)
    try:
        yield
    finally:
        for setter, on in zip((b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp, b.enable_cudnn_sdp),
                              saved):
            setter(on)


def flash_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, used_k):
    """FlashAttention-2 varlen forward (torch's bundled copy): packed q ``(Tq, H, D)``, k/v ``(Tk, Hk, D)``."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=used_k
    )[0]


def flash_varlen(query, key, value, lengths, scale, causal):
    """Exact attention over the first ``lengths[b]`` slots of each sequence of an HF-layout static cache.

    query ``(B, Hq, L, D)``; key/value ``(B, Hkv, M, D)`` contiguous, read in place: each (sequence,
    KV head) pair is one varlen "sequence" of M tokens with one KV head and the ``Hq / Hkv`` query heads
    of its group (``key.view(B * Hkv * M, 1, D)``: no copy), of which ``seqused_k = lengths[b]`` are
    used; causal is bottom-right aligned to that length. ``lengths``: int32 ``(B,)`` on the device.
    Returns ``(B, L, Hq, D)``.
    """
    batch, heads, rows, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = heads // kv_heads
    pairs = batch * kv_heads
    k = key.reshape(pairs * slots, 1, dim)
    v = value.reshape(pairs * slots, 1, dim)
    q = query.reshape(batch, kv_heads, group, rows, dim).transpose(2, 3).reshape(pairs * rows, group, dim)
    steps = torch.arange(pairs + 1, dtype=torch.int32, device=query.device)
    used = lengths.to(torch.int32).repeat_interleave(kv_heads)
    out = FLASH_KERNEL(q, k, v, steps * rows, steps * slots, rows, slots, causal, scale, used)
    return out.reshape(batch, kv_heads, rows, group, dim).permute(0, 2, 1, 3, 4).reshape(batch, rows, heads, dim)


FLASH_KERNEL = flash_kernel  # replaceable by a plain-PyTorch emulation in the CPU test


def dense_core(backend, query, key, value, mask, position_ids, scale):
    """Exact attention of ``query`` rows (positions ``position_ids``, no left padding) over the cache. -> (B, L, Hq, D)."""
    if backend == "flash-varlen":
        lengths = (position_ids[:, -1] + 1).to(torch.int32)
        return flash_varlen(query, key, value, lengths, scale, causal=query.shape[2] > 1)
    if mask is None:
        # transformers skips the mask only when every key is visible: a single row attends to all
        # slots; several rows are a prefill from position 0 without padding (the first ``rows`` slots).
        rows = query.shape[2]
        keys = slice(None) if rows == 1 else slice(0, rows)
        out = F.scaled_dot_product_attention(query, key[:, :, keys], value[:, :, keys], is_causal=rows > 1,
                                             scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def dense_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function ``"bench_dense"``: :func:`dense_core` with the backend chosen for the cell."""
    backend = DENSE_STATE["decode" if query.shape[2] == 1 else "prefill"]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = dense_core(backend, query, key, value, attention_mask, kwargs.get("position_ids"), scale)
    return out.contiguous(), None


def register_dense_attention():
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(DENSE_ATTENTION_NAME, dense_attention_forward)
    AttentionMaskInterface.register(DENSE_ATTENTION_NAME, sdpa_mask)


def reference_attention(query, key, value, valid: int, rows: int):
    """float32 attention of the last ``rows`` positions ending at ``valid`` (causal), per KV head. -> (B, L, Hq, D)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    out = torch.empty(batch, rows, heads, dim, dtype=torch.float32, device=query.device)
    positions = torch.arange(valid - rows, valid, device=query.device)
    allowed = torch.arange(valid, device=query.device)[None, :] <= positions[:, None]       # (L, valid)
    for b in range(batch):
        for h in range(kv_heads):
            k = key[b, h, :valid].float()
            v = value[b, h, :valid].float()
            q = query[b, h * group:(h + 1) * group].float()                                  # (G, L, D)
            scores = (q @ k.T) * dim ** -0.5
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[b, :, h * group:(h + 1) * group] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def check_dense_backends(cache, config, valid: int, device, dtype, candidates, rows: int = 1, time_it=True):
    """Run each candidate on layer 0 of the real cache against a float32 reference; time the passing ones.

    Returns a list of dicts: backend, ok, error (relative), reason, attention_s_per_step (all layers).
    """
    layer = cache.layers[0]
    batch = layer.keys.shape[0]
    slots = layer.keys.shape[2]
    g = torch.Generator(device=device).manual_seed(5)
    query = torch.randn(batch, config.num_attention_heads, rows, config.head_dim, generator=g, device=device,
                        dtype=dtype) * 1.3
    position_ids = torch.arange(valid - rows, valid, device=device)[None].expand(batch, rows)
    mask = (torch.arange(slots, device=device)[None, :] <= position_ids[0][:, None])[None, None].expand(
        batch, 1, rows, slots).contiguous()
    want = reference_attention(query, layer.keys, layer.values, valid, rows)
    results = []
    for backend in candidates:
        if backend == "sdpa-math" and len(candidates) > 1 and any(r["ok"] for r in results):
            continue  # the fallback: only needed (and only worth its K/V copies) when nothing else passed
        entry = {"backend": backend, "rows": rows}
        try:
            with sdpa_backend(backend, device):
                got = dense_core(backend, query, layer.keys, layer.values, mask, position_ids, config.head_dim ** -0.5)
                err = float((got.float() - want).norm() / want.norm().clamp_min(1e-12))
                entry["relative_error"] = err
                entry["ok"] = bool(math.isfinite(err) and err < 2e-2)
                if entry["ok"] and time_it:
                    layers = cache.layers

                    def all_layers():
                        for lay in layers:
                            dense_core(backend, query, lay.keys, lay.values, mask, position_ids,
                                       config.head_dim ** -0.5)

                    entry["attention_s_per_step"] = time_replays(all_layers, device)
        except Exception as error:  # a backend that refuses the shape is reported and skipped
            entry["ok"] = False
            entry["reason"] = f"{type(error).__name__}: {str(error)[:300]}"
        results.append(entry)
        print(f"    dense check {backend} rows={rows}: "
              + (f"ok, rel. error {entry['relative_error']:.1e}" if entry.get("ok") else
                 f"rejected ({entry.get('reason') or 'rel. error %.1e' % entry.get('relative_error', float('nan'))})")
              + (f", all-layer attention {1e3 * entry['attention_s_per_step']:.3f} ms"
                 if "attention_s_per_step" in entry else ""), flush=True)
    return results


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


def rewind(cache, valid: int):
    for layer in cache.layers:
        layer.cumulative_length.fill_(valid)


# ---- one method ---------------------------------------------------------------------------------------

def hash_config(method: Method, args, slots: int):
    from hashattention.config import HashAttentionConfig

    common = dict(sink_tokens=args.sink, local_tokens=args.local, selection=method.selection, sparse_prompt_tokens=0)
    if method.full:
        return HashAttentionConfig(budget_tokens=max(slots, args.sink + args.local), **common)
    return HashAttentionConfig(sparsity=method.sparsity, **common)


def make_forward(model, mode: str):
    if mode == "reduce-overhead":
        return torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    if mode == "cudagraphs":
        return torch.compile(model.forward, backend="cudagraphs", fullgraph=True)
    if mode == "eager":
        return torch.compile(model.forward, backend="eager", fullgraph=True)
    return model.forward


def decode(forward, cache, first_token, start: int, steps: int, full_mask, device, mark_steps: bool):
    """``steps`` greedy steps from position ``start``; returns the (B, steps) tokens tensor (on the device)."""
    batch = first_token.shape[0]
    token = first_token
    positions = torch.full((batch, 1), start, dtype=torch.long, device=device)
    chosen = []
    for _ in range(steps):
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        out = forward(input_ids=token, attention_mask=full_mask, position_ids=positions, past_key_values=cache,
                      use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        chosen.append(token)
        positions = positions + 1
    return torch.cat(chosen, dim=1)


def paced_step_ms(forward, cache, first_token, start: int, steps: int, full_mask, device, mark_steps: bool) -> float:
    """Median GPU milliseconds of one decode step run alone: each step is issued after the GPU went idle
    (a sync before it) and timed by CUDA events around it. Against the back-to-back ``ms_per_step`` this
    separates what a step costs by itself from what running steps back to back adds or hides (queued
    launches, clocks under sustained load)."""
    times = []
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with Timer(device) as t:
            decode(forward, cache, first_token, start + step, 1, full_mask, device, mark_steps)
        times.append(1e3 * t.seconds)
    return float(statistics.median(times))


def compile_counters():
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
    }


KERNEL_CATEGORIES = (  # first match wins; lower-case substrings of CUDA kernel names (namespaces dropped)
    ("encode", ("mlp_sign", "sign_pack")),  # fused_ / cluster_ / mma_mlp_sign_kernel, pack_signs
    ("selection", ("resident_select", "histogram_kernel", "compact_kernel", "threshold", "radix_select", "hamming", "topk")),
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "softmax")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce", "cublas", "aten::mm", "aten::addmm",
              "aten::bmm")),
)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")


def kernel_category(name: str) -> str:
    # "hashattention::" would match "attention": every kernel of this project lives in that namespace.
    lowered = name.lower().replace("hashattention::", "")
    return next((c for c, keys in KERNEL_CATEGORIES if any(k in lowered for k in keys)), "other")


def profile_decode(forward, cache, first_token, valid: int, steps: int, full_mask, device, mark: bool,
                   trace_path: Optional[str] = None) -> dict:
    """Kernel time per decode step by category (and the top kernels), and host-sync runtime calls per step.

    CUDA: GPU kernels. ``attention`` = attention kernels (FlashAttention / cuDNN / SDPA /
    ``sparse_attention_kernel``), ``selection`` = HashAttention's top-k kernels, ``encode`` = its
    signature encoder (a decode-step kernel: fused, cluster or tensor-core; or sign-and-pack after
    cuBLAS products, which then count under ``gemm`` with the model's). Host syncs exclude the
    profiler's own when it stops. CPU (smoke
    tests): the self time of the operators instead of kernels. With ``trace_path``, the Chrome trace is
    written there and ``timeline`` says where the GPU idled between kernels (``timeline_gaps.summarize``).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    rewind(cache, valid)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # The profiler synchronizes the device when it stops; an empty profile counts those calls, so
    # that only the decode steps' own synchronizations are reported.
    with profile(activities=activities) as empty:
        pass
    profiler_syncs = {e.key: e.count for e in empty.key_averages() if e.key in SYNC_CALLS}
    with profile(activities=activities) as prof:
        decode(forward, cache, first_token, valid, steps, full_mask, device, mark)
    if cuda:
        torch.cuda.synchronize()
    categories: Dict[str, float] = {}
    kernels, syncs = [], {}
    for event in prof.key_averages():
        if event.key in SYNC_CALLS and event.count > profiler_syncs.get(event.key, 0):
            syncs[event.key] = (event.count - profiler_syncs.get(event.key, 0)) / steps
        if cuda:
            if getattr(event, "device_type", None) != DeviceType.CUDA:
                continue
            micros = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        else:
            micros = event.self_cpu_time_total
        if micros <= 0:
            continue
        category = kernel_category(event.key)
        categories[category] = categories.get(category, 0.0) + micros / steps
        kernels.append({"kernel": event.key[:160], "category": category, "us_per_step": micros / steps,
                        "launches_per_step": event.count / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    total = sum(categories.values())
    return {
        "steps": steps, "device": "cuda kernels" if cuda else "cpu operators (self time)",
        "kernel_us_per_step": total, "category_us_per_step": categories,
        "attention_and_selection_share_of_kernel_time":
            (categories.get("attention", 0.0) + categories.get("selection", 0.0)) / total if total else None,
        "host_sync_calls_per_step": syncs, "launches_per_step": sum(k["launches_per_step"] for k in kernels),
        "top_kernels": kernels[:40],
        **({"timeline": trace_timeline(prof, trace_path, steps)} if trace_path else {}),
    }


def trace_timeline(prof, path: str, steps: int) -> dict:
    """Write the profiler's Chrome trace to ``path`` and summarize the GPU's idle gaps in it."""
    from timeline_gaps import load_events, render, summarize

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof.export_chrome_trace(path)
    summary = summarize(load_events(path), steps)
    print("    timeline: " + render(summary).replace("\n", "\n      "), flush=True)
    return summary


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


# ---- results ------------------------------------------------------------------------------------------

def human_n(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def environment(args, device) -> dict:
    import transformers

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": platform.python_version(), **provenance.describe(),
    }


# Environment variables that change what a run measures: the package's timing aids (for example
# HASHATTENTION_ENCODER), inductor's settings and the CUDA runtime's. Each run records the ones set,
# so that its rows can be reproduced.
MEASURED_ENVIRONMENT_PREFIXES = ("HASHATTENTION_", "TORCHINDUCTOR_")
MEASURED_ENVIRONMENT_NAMES = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "CUDA_LAUNCH_BLOCKING",
                              "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING")


def measured_environment() -> Dict[str, str]:
    """The set variables of MEASURED_ENVIRONMENT_PREFIXES / _NAMES, by name."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(MEASURED_ENVIRONMENT_PREFIXES) or name in MEASURED_ENVIRONMENT_NAMES}


def cell_key(row) -> tuple:
    return (row["B"], row["n"], row["method"])


def load_previous(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_results(record: dict, json_path: str, md_path: str) -> None:
    for path, text in ((json_path, json.dumps(record, indent=1)), (md_path, markdown(record))):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def environment_note(run: dict) -> str:
    """"; environment: `A=1 B=2`" for a run that recorded set variables (runs before they were recorded: "")."""
    names = run.get("environment") or {}
    return "; environment: `" + " ".join(f"{k}={v}" for k, v in names.items()) + "`" if names else ""


def markdown(record: dict) -> str:
    rows = sorted(record["rows"], key=lambda r: (r["B"], r["n"], r.get("order", 0)))
    lines = [
        "# End-to-end decode throughput: Llama-3.1-8B architecture, random bf16 weights",
        "",
        f"- updated: {record['updated_utc']}; device: {record['env']['device']}; torch {record['env']['torch']}, "
        f"CUDA {record['env']['cuda']}, transformers {record['env']['transformers']}, {provenance.label(record['env'])}",
        "- commands (each run merges its rows into this file):",
        *[f"  - `{run['command']}` ({run['started_utc']}; fill: {run['fill']}, compile: {run['compile']}, "
          f"{run['model']}{environment_note(run)})" for run in record["runs"]],
        "- tokens/s = B x steps / time of `steps` greedy decode steps (CUDA events, one sync at the end); ratio = "
        "tokens/s over dense's in the same (B, n); attention share = all layers' attention alone "
        "(CUDA-graph replay on the cell's cache) / ms per step; KV = K+V bytes of n tokens; signatures = the "
        "method's key-signature bytes of n tokens.",
        "",
        "| B | n | method | tokens/s | ms/step | ratio to dense | attention share | KV GB | signatures MB "
        "| compile s | graph breaks | cudagraph skips | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['B']} | {human_n(r['n'])} | {r['method']} | - | - | - | - | - | - | - | - | - | "
                         f"{r['status']}: {r.get('reason', '')[:160]} |")
            continue
        share = r.get("attention_share")
        notes = []
        if r.get("dense_backend"):
            notes.append(f"backend {r['dense_backend']}")
        if r.get("paced_ms_per_step"):
            notes.append(f"{r['paced_ms_per_step']:.2f} ms a step alone")
        if r.get("first_divergence_from_dense") is not None:
            notes.append(f"tokens = dense for {r['first_divergence_from_dense']} steps")
        if "ran_before_in_process" in r:
            before = len(r["ran_before_in_process"])
            notes.append("first GPU work of its process" if not before else
                         f"{before} GPU job{'s' if before > 1 else ''} before it in its process")
        lines.append(
            f"| {r['B']} | {human_n(r['n'])} | {r['method']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
            f"{fmt(r.get('ratio_to_dense'), '.2f')}{'x' if r.get('ratio_to_dense') else ''} | "
            f"{fmt(None if share is None else 100 * share, '.0f')}{'%' if share is not None else ''} | "
            f"{r['kv_bytes'] / 1e9:.3g} | {r['signature_bytes'] / 1e6:.4g} | {fmt(r.get('compile_s'), '.1f')} | "
            f"{r.get('graph_breaks', '-')} | {r.get('cudagraph_skips', '-')} | {'; '.join(notes)} |")
    lines += ["", "## Cache fill per (B, n)", "",
              "| B | n | fill | fill s | prefill s | signature encode s (per-query-head keys) | (per-KV-head keys) |",
              "|---|---|---|---|---|---|---|"]
    for f in sorted(record["fills"], key=lambda f: (f["B"], f["n"])):
        enc = f.get("encode_s", {})
        lines.append(f"| {f['B']} | {human_n(f['n'])} | {f['fill']} | {fmt(f.get('fill_s'), '.2f')} | "
                     f"{fmt(f.get('prefill_s'), '.2f')} | {fmt(enc.get('query'), '.3f')} | {fmt(enc.get('kv'), '.3f')} |")
    profiled = [r for r in rows if r["status"] == "ok" and "category_us_per_step" in r.get("profile", {})]
    if profiled:
        lines += ["", "## Profile of extra decode steps (torch.profiler; kernel µs per step)", "",
                  "| B | n | method | all kernels | attention | selection | encode | gemm | other | host syncs per step "
                  "| kernels per graph replay | idle µs inside a replay |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in profiled:
            p, c = r["profile"], r["profile"]["category_us_per_step"]
            replays = (p.get("timeline") or {}).get("graph_replays") or {}  # with --trace-dir
            syncs = ", ".join(f"{k} {v:g}" for k, v in p["host_sync_calls_per_step"].items()) or "none"
            lines.append(f"| {r['B']} | {human_n(r['n'])} | {r['method']} | {p['kernel_us_per_step']:.0f} | "
                         + " | ".join(f"{c.get(k, 0.0):.0f}" for k in ("attention", "selection", "encode", "gemm", "other"))
                         + f" | {syncs} | {fmt(replays.get('kernels'), 'g')} | {fmt(replays.get('idle_inside_us'), '.0f')} |")
    lines += ["", "## Targets (issue 7)", ""]
    lines += [target_line(record, *t) for t in TARGETS]
    return "\n".join(lines)


def comparable_key(row: dict) -> tuple:
    """Rows with the same key ran the same cell setup, so their tokens/s and tokens compare."""
    return row["B"], row["n"], row.get("fill"), row.get("steps")


def link_to_later_dense(rows: List[dict], dense: dict) -> None:
    """Give the rows of ``dense``'s cell that ran before it (an earlier process of the day, one method per
    process) their ratio and token agreement with it, as a dense row run first would have."""
    for r in rows:
        if (r is dense or r["status"] != "ok" or r["method"] == "dense" or r.get("ratio_to_dense") is not None
                or comparable_key(r) != comparable_key(dense)):
            continue
        r["ratio_to_dense"] = r["tokens_per_s"] / dense["tokens_per_s"]
        r["first_divergence_from_dense"] = first_divergence(r["generated_tokens"], dense["generated_tokens"])
        r["dense_from_later_run"] = True


def target_line(record, batch, n, method, target) -> str:
    row = next((r for r in record["rows"] if (r["B"], r["n"], r["method"]) == (batch, n, method)), None)
    label = f"B = {batch}, {human_n(n)}, {method}: target >= {target}x tokens/s over dense"
    if row is None or row["status"] != "ok" or row.get("ratio_to_dense") is None:
        return f"- {label}: **not measured**" + (f" ({row['status']}: {row.get('reason', '')})" if row else "")
    ratio = row["ratio_to_dense"]
    if ratio >= target:
        return f"- {label}: **met**, {ratio:.2f}x ({ratio - target:+.2f}x)"
    return f"- {label}: **missed**, {ratio:.2f}x, short by {target - ratio:.2f}x ({100 * (1 - ratio / target):.0f}%)"


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
        torch.manual_seed(args.seed)
        register_dense_attention()

        today = datetime.datetime.now(datetime.timezone.utc)
        os.makedirs(args.out, exist_ok=True)
        self.json_path = os.path.join(args.out, f"bench_generate_{today:%Y%m%d}.json")
        self.md_path = self.json_path[:-5] + ".md"
        self.record = {} if args.fresh else load_previous(self.json_path)
        for key in ("rows", "fills", "runs", "dense_checks"):
            self.record.setdefault(key, [])
        self.record["env"] = environment(args, self.device)
        words = list(argv) if argv is not None else sys.argv[1:]
        command = "python scripts/bench_generate.py " + " ".join(shlex.quote(w) for w in words)
        print(f"{command}\n{self.record['env']}", flush=True)

        self.config = model_config(args, max(args.contexts) + args.steps + args.warmup + 8)
        with Timer(self.device) as t:
            self.model = build_model(self.config, self.device, self.dtype)
        c = self.config
        described = (f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads}/"
                     f"{c.num_key_value_heads} heads, head_dim {c.head_dim}, vocab {c.vocab_size}, {self.dtype}")
        print(f"model built in {t.seconds:.1f} s: {described}", flush=True)
        self.record["runs"].append({
            "command": command, "started_utc": f"{today:%Y-%m-%d %H:%M} UTC", "fill": args.fill,
            "compile": args.compile, "model": described, "steps": args.steps, "warmup": args.warmup,
            "sink": args.sink, "local": args.local, "model_build_s": t.seconds,
            "environment": measured_environment()})
        self.families = sorted({m.family for m in args.method_specs if m.family})
        self.adapters = {f: build_adapters(c, f, self.device, self.dtype) for f in self.families}
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # What this random model's k_proj gives for RMS-normalised inputs: std 0.02 * sqrt(hidden).
        self.key_std = c.initializer_range * math.sqrt(c.hidden_size)
        self.order = {m.name: i for i, m in enumerate(args.method_specs)}
        # GPU work this process did before each method (dense backend checks, earlier methods): a B = 4 step
        # was measured ~0.3 ms faster where a warm-cached compile was a process's first GPU work
        # (bench_generate_20261203_s21_states.md), so every row says what ran before it.
        self.ran_before: List[str] = []
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
        r["updated_utc"] = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        write_results(r, self.json_path, self.md_path)

    def base_row(self, batch: int, n: int, method: Method) -> dict:
        a = self.args
        return {"B": batch, "n": n, "method": method.name, "order": self.order[method.name], "fill": a.fill,
                "compile": a.compile, "steps": a.steps, "ran_before_in_process": list(self.ran_before)}

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
        print("\n".join(target_line(self.record, *t) for t in TARGETS), flush=True)
        return self.record

    def choose_prefill_backend(self) -> None:
        """Prefill needs a multi-row dense backend: check the candidates once on a small cache of the model's shapes."""
        probe = new_static_cache(self.model, 1, 1024, self.device, self.dtype)
        fill_random(probe, 1024, self.key_std, self.args.seed)
        candidates = DENSE_CANDIDATES_CUDA if self.device.type == "cuda" else ("sdpa-math",)
        checks = check_dense_backends(probe, self.config, 1000, self.device, self.dtype, candidates, rows=16,
                                      time_it=False)
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
        """Without dense in this run, compare with a dense row of an earlier run of the day on the same cell setup."""
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    return Benchmark(args, argv).run()


def first_divergence(tokens, reference) -> Optional[int]:
    """Number of leading steps where every sequence's token equals the reference's."""
    if reference is None or len(tokens) != len(reference):
        return None
    steps = len(tokens[0])
    for step in range(steps):
        if any(row[step] != ref[step] for row, ref in zip(tokens, reference)):
            return step
    return steps


if __name__ == "__main__":
    main()
