"""Dense attention for ``benchmarks.decode_loop``: exact attention over the valid prefix of a static
cache, through the fastest backend that passes a float32 check on the cell's real cache.

Backends: ``flash-varlen`` (FlashAttention-2 varlen with per-sequence used lengths, reading the
static cache in place), ``sdpa-cudnn`` / ``sdpa-efficient`` / ``sdpa-math`` (SDPA over all slots
with the boolean mask). Registered with transformers as the attention function ``"bench_dense"``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from benchmarks.decode_loop_timing import time_replays


DENSE_ATTENTION_NAME = "bench_dense"


DENSE_CANDIDATES_CUDA = ("flash-varlen", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")


SDPA_FLAGS = {  # backend -> (flash, mem_efficient, math, cudnn) enabled
    "sdpa-cudnn": (False, False, False, True),
    "sdpa-efficient": (False, True, False, False),
    "sdpa-math": (False, False, True, False),
}


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


def check_dense_backends(cache, config, valid: int, device, dtype, candidates, rows: int = 1, time_it=True,
                         first_passing=False):
    """Run each candidate on layer 0 of the real cache against a float32 reference; time the passing ones.

    ``first_passing``: stop at the first candidate that passes (the others are never run, so a process
    that needs no cuDNN does not initialize it: see ``benchmarks.decode_loop_processes``).
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
        if first_passing and any(r["ok"] for r in results):
            break
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
