"""Which earlier GPU work puts a process's decode graphs into the slow state?

A B = 4 / 128K per-query-head decode step takes ~8.6 ms in some processes and ~8.9 ms in others, with
the same kernels: the GPU idles ~440 µs per CUDA-graph replay between nodes in the slow state, ~90 µs
in the fast one (benchmarks/results/bench_generate_20261203_s21_states.md). The fast state was only
seen where the warm-cached compile of the HashAttention method came first in its process; the dense
backend checks (cuDNN and FlashAttention SDPA) or a cold compile before it gave the slow state.

This runs one kind of GPU work (``--pre``), then ``bench_generate.main`` with the remaining
arguments, so that one process per kind shows which of them flips the state:

    python scripts/probe_process_state.py --pre cudnn -- --contexts 131072 --batches 4 \\
        --methods hash-query_head-32 --no-attention-share --profile-steps 0 --out /tmp/o

Kinds: ``none``; ``cudnn`` / ``flash`` / ``efficient`` (one eager SDPA call through that backend);
``matmul`` (one bf16 cuBLAS GEMM); ``triton`` (one freshly compiled inductor kernel, autotuned);
``modules`` (20 small inductor kernels, each its own runtime-loaded module); ``conv`` (one cuDNN
convolution);
``stack`` (``cudaDeviceSetLimit(cudaLimitStackSize, 16 KiB)``, as a kernel with a deep stack
would make the driver do); ``carveout`` (``cudaDeviceSetCacheConfig(cudaFuncCachePreferShared)``).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KINDS = ("none", "cudnn", "flash", "efficient", "matmul", "triton", "modules", "conv", "stack", "carveout")


@functools.lru_cache(maxsize=None)
def cudart():
    """The CUDA runtime library torch loaded (ctypes handle)."""
    torch.cuda.init()
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("probe_process_state: no libcudart found for --pre stack/carveout")


def call_cudart(name: str, *args) -> None:
    rc = getattr(cudart(), name)(*args)
    if rc != 0:
        raise SystemExit(f"probe_process_state: {name} returned {rc}")


def sdpa(backend) -> None:
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([backend]):
        torch.nn.functional.scaled_dot_product_attention(q, k, k)


def pre_work(kind: str) -> None:
    from torch.nn.attention import SDPBackend

    if kind == "none":
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"probe_process_state: --pre {kind} needs a CUDA device")
    if kind == "cudnn":
        sdpa(SDPBackend.CUDNN_ATTENTION)
    elif kind == "flash":
        sdpa(SDPBackend.FLASH_ATTENTION)
    elif kind == "efficient":
        sdpa(SDPBackend.EFFICIENT_ATTENTION)
    elif kind == "matmul":
        a = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        (a @ b).sum().item()
    elif kind == "triton":
        @torch.compile(mode="max-autotune-no-cudagraphs")
        def f(x, y):
            return torch.nn.functional.silu(x) * y + x.sum(-1, keepdim=True)

        x = torch.randn(1000, 1003, device="cuda")
        f(x, x)
    elif kind == "modules":  # many small runtime-loaded modules, no autotuning
        x = torch.randn(1000, device="cuda")
        for i in range(20):
            torch.compile(lambda t, i=i: torch.sin(t * (i + 1)) + i, dynamic=False)(x)
    elif kind == "conv":  # cuDNN's precompiled convolution kernels (no runtime-compiled engine)
        image = torch.randn(4, 64, 56, 56, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16)
        torch.nn.functional.conv2d(image, weight, padding=1)
    elif kind == "stack":
        call_cudart("cudaDeviceSetLimit", ctypes.c_int(0), ctypes.c_size_t(16 << 10))  # cudaLimitStackSize
    elif kind == "carveout":
        call_cudart("cudaDeviceSetCacheConfig", ctypes.c_int(1))  # cudaFuncCachePreferShared
    torch.cuda.synchronize()


CACHE_CONFIGS = {0: "PreferNone", 1: "PreferShared", 2: "PreferL1", 3: "PreferEqual"}


def device_cache_config() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    value = ctypes.c_int(-1)
    rc = cudart().cudaDeviceGetCacheConfig(ctypes.byref(value))
    return f"error {rc}" if rc != 0 else CACHE_CONFIGS.get(value.value, str(value.value))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pre", choices=KINDS, required=True, help="GPU work to run before bench_generate")
    parser.add_argument("--reset", action="store_true",
                        help="after --pre, set the device cache config back to cudaFuncCachePreferNone")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench_generate.py's arguments")
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    started = time.monotonic()
    print(f"probe_process_state: cache config at start {device_cache_config()}", flush=True)
    pre_work(args.pre)
    print(f"probe_process_state: --pre {args.pre} done in {time.monotonic() - started:.1f} s; cache config "
          f"{device_cache_config()}", flush=True)
    if args.reset and torch.cuda.is_available():
        call_cudart("cudaDeviceSetCacheConfig", ctypes.c_int(0))  # cudaFuncCachePreferNone
        print(f"probe_process_state: reset to PreferNone: {device_cache_config()}", flush=True)
    import bench_generate

    result = bench_generate.main(rest)
    for row in result.get("rows", []):
        print(f"probe_process_state: --pre {args.pre}{' --reset' if args.reset else ''} {row.get('method')} B={row.get('B')} n={row.get('n')} "
              f"ms/step {row.get('ms_per_step', float('nan')):.3f}", flush=True)


if __name__ == "__main__":
    main()
