"""Profile of decode steps for ``benchmarks.decode_loop``: kernel time per step by category, the
host's synchronisations, and (with a trace path) where the GPU idled between kernels.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from benchmarks.decode_loop_timing import decode, rewind


KERNEL_CATEGORIES = (  # first match wins; lower-case substrings of CUDA kernel names (namespaces dropped)
    ("encode", ("mlp_sign", "sign_pack")),  # fused_ / cluster_ / mma_mlp_sign_kernel, pack_signs
    ("selection", ("resident_select", "histogram_kernel", "compact_kernel", "threshold", "radix_select", "hamming", "topk")),
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "softmax")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce", "cublas", "aten::mm", "aten::addmm",
              "aten::bmm")),
)


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")
HOST_CALLS_KEPT = 8  # the CUDA runtime / driver calls with the most host time per step


def is_cuda_api_call(name: str) -> bool:
    """A CUDA runtime (``cudaGraphLaunch``) or driver (``cuLaunchKernelEx``) call as the profiler names it."""
    return any(name.startswith(prefix) and name[len(prefix):len(prefix) + 1].isupper() for prefix in ("cuda", "cu"))


def kernel_category(name: str) -> str:
    # "hashattention::" would match "attention": every kernel of this project lives in that namespace.
    lowered = name.lower().replace("hashattention::", "")
    return next((c for c, keys in KERNEL_CATEGORIES if any(k in lowered for k in keys)), "other")


def profile_decode(forward, cache, first_token, valid: int, steps: int, full_mask, device, mark: bool,
                   trace_path: Optional[str] = None) -> dict:
    """Kernel time per decode step by category (and the top kernels), host-sync runtime calls per step, and
    the host time of the CUDA API calls with the most of it.

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
    kernels, syncs, host_calls = [], {}, {}
    for event in prof.key_averages():
        if event.key in SYNC_CALLS and event.count > profiler_syncs.get(event.key, 0):
            syncs[event.key] = (event.count - profiler_syncs.get(event.key, 0)) / steps
        if getattr(event, "device_type", None) == DeviceType.CPU and is_cuda_api_call(event.key):
            host_calls[event.key] = {"host_us_per_step": event.cpu_time_total / steps,
                                     "calls_per_step": event.count / steps}
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
        "host_sync_calls_per_step": syncs,
        # Where the host's issue time goes: a call that blocks (a graph launch waiting for the GPU, say)
        # shows here with about a step's time even when no synchronizing call was made.
        "host_calls_us_per_step": dict(
            sorted(host_calls.items(), key=lambda kv: -kv[1]["host_us_per_step"])[:HOST_CALLS_KEPT]),
        "launches_per_step": sum(k["launches_per_step"] for k in kernels),
        "top_kernels": kernels[:40],
        **({"timeline": trace_timeline(prof, trace_path, steps)} if trace_path else {}),
    }


def trace_timeline(prof, path: str, steps: int) -> dict:
    """Write the profiler's Chrome trace to ``path`` and summarize the GPU's idle gaps in it."""
    from tools.timeline_gaps import load_events, render, summarize

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof.export_chrome_trace(path)
    summary = summarize(load_events(path), steps)
    print("    timeline: " + render(summary).replace("\n", "\n      "), flush=True)
    return summary
