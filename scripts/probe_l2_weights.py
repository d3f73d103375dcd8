"""Can a decode step keep the next weight matrix in L2 across the sparse attention's streams?

A question for the end-to-end benchmark (issue 7), answered before any kernel changes: at B = 4 the
HashAttention step leaves DRAM idle during the encoder (~9 us per layer, latency-bound) and the
selection's second phase, and then streams ~335 MB (signatures, then selected K/V rows) before the
output projection reads its 33.5 MB of weights from DRAM. If those weights were fetched into L2
during the idle time and survived the streams, the projection would read them from L2.

This probe times the projection's cuBLAS GEMM (x[4, 4096] @ W[4096, 4096]^T, bf16) after:
  cold        a 335 MB stream with normal loads (W evicted: what the step does now);
  hot         W read just before (the best case);
  and after W is fetched by a prefetch kernel, then the 335 MB stream, for each combination of
  the prefetch's L2 priority (normal / evict_last prefetch instructions, or evict_last loads) and
  the stream's (normal / evict_first cache hints),
first with the driver's default persisting-L2 set-aside, then with the set-aside at its maximum.
Kernel durations come from the profiler (median over the repetitions).

    python scripts/probe_l2_weights.py [--stream-mb 335] [--reps 30] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

CUDA_SOURCE = r"""
#include <cuda_runtime.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

// mode 0: normal loads; 1: evict_first cache hint on every load.
__global__ void stream_read(const int4* __restrict__ p, long long n, int mode, int* sink) {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  int acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    int4 v;
    if (mode == 1) {
      asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.s32 {%0,%1,%2,%3}, [%4], %5;"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i), "l"(policy));
    } else {
      asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
    }
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678) sink[0] = acc;  // keeps the loads
}

// mode 0: prefetch.global.L2; 1: prefetch.global.L2::evict_last; 2: loads with an evict_last hint;
// 3: normal loads.
__global__ void fetch_lines(const char* __restrict__ p, long long bytes, int mode, int* sink) {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  int acc = 0;
  for (long long off = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 128; off < bytes;
       off += (long long)gridDim.x * blockDim.x * 128) {
    const char* a = p + off;
    if (mode == 0) {
      asm volatile("prefetch.global.L2 [%0];" :: "l"(a));
    } else if (mode == 1) {
      asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(a));
    } else if (mode == 2) {
      int v;
      asm volatile("ld.global.L1::no_allocate.L2::cache_hint.s32 %0, [%1], %2;" : "=r"(v) : "l"(a), "l"(policy));
      acc ^= v;
    } else {
      int v;
      asm volatile("ld.global.L1::no_allocate.s32 %0, [%1];" : "=r"(v) : "l"(a));
      acc ^= v;
    }
  }
  if (acc == 0x12345678) sink[0] = acc;
}

void stream(torch::Tensor t, int64_t mode, torch::Tensor sink) {
  const long long n = t.numel() * t.element_size() / 16;
  stream_read<<<132 * 8, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int4*>(t.data_ptr()), n, (int)mode, sink.data_ptr<int>());
}

void fetch(torch::Tensor t, int64_t mode, int64_t blocks, torch::Tensor sink) {
  fetch_lines<<<(int)blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const char*>(t.data_ptr()), (long long)(t.numel() * t.element_size()), (int)mode,
      sink.data_ptr<int>());
}

std::vector<int64_t> l2_info() {
  int dev; cudaGetDevice(&dev);
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, dev);
  size_t limit = 0; cudaDeviceGetLimit(&limit, cudaLimitPersistingL2CacheSize);
  return {prop.l2CacheSize, prop.persistingL2CacheMaxSize, (int64_t)limit, prop.accessPolicyMaxWindowSize};
}

int64_t set_persisting(int64_t bytes) {
  cudaError_t e = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, (size_t)bytes);
  size_t limit = 0; cudaDeviceGetLimit(&limit, cudaLimitPersistingL2CacheSize);
  return e == cudaSuccess ? (int64_t)limit : -(int64_t)e;
}

void reset_persisting() { cudaCtxResetPersistingL2Cache(); }
"""

CPP_SOURCE = r"""
void stream(torch::Tensor t, int64_t mode, torch::Tensor sink);
void fetch(torch::Tensor t, int64_t mode, int64_t blocks, torch::Tensor sink);
std::vector<int64_t> l2_info();
int64_t set_persisting(int64_t bytes);
void reset_persisting();
"""

FETCH_MODES = {"prefetch": 0, "prefetch_evict_last": 1, "load_evict_last": 2, "load": 3}
STREAM_MODES = {"normal": 0, "evict_first": 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream-mb", type=int, default=335, help="bytes streamed between the fetch and the GEMM")
    parser.add_argument("--rows", type=int, default=4, help="GEMM rows (the decode batch)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--fetch-blocks", type=int, default=264, help="blocks of the fetch kernel")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    t0 = time.time()
    ext = load_inline("probe_l2_weights", CPP_SOURCE, cuda_sources=CUDA_SOURCE,
                      functions=["stream", "fetch", "l2_info", "set_persisting", "reset_persisting"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
    print(f"compiled in {time.time() - t0:.0f} s")
    dev = torch.device("cuda")
    weight = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(args.rows, 4096, device=dev, dtype=torch.bfloat16)
    big = torch.empty(args.stream_mb * 2**20 // 2, device=dev, dtype=torch.bfloat16).normal_()
    sink = torch.zeros(1, device=dev, dtype=torch.int32)
    l2, persist_max, persist_now, window_max = ext.l2_info()
    print(f"L2 {l2 / 2**20:.0f} MiB, persisting max {persist_max / 2**20:.1f} MiB, set-aside now "
          f"{persist_now / 2**20:.1f} MiB, access window max {window_max / 2**20:.0f} MiB")

    def scenario(fetch_mode: str | None, stream_mode: str | None) -> None:
        if fetch_mode is not None:
            ext.fetch(weight, FETCH_MODES[fetch_mode], args.fetch_blocks, sink)
        if stream_mode is not None:
            ext.stream(big, STREAM_MODES[stream_mode], sink)
        torch.nn.functional.linear(x, weight)

    def timed(fetch_mode: str | None, stream_mode: str | None, pre_stream: bool) -> dict:
        for _ in range(3):
            if pre_stream:
                ext.stream(big, 0, sink)
            scenario(fetch_mode, stream_mode)
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                if pre_stream:  # evict W first, so only this repetition's fetch can bring it
                    ext.stream(big, 0, sink)
                scenario(fetch_mode, stream_mode)
            torch.cuda.synchronize()
        # Per repetition: the summed device time of each kind of kernel (cuBLAS may add a split-K reduction).
        totals = {"gemm": 0.0, "fetch": 0.0, "stream": 0.0}
        for avg in prof.key_averages():
            us = getattr(avg, "self_device_time_total", None)
            if us is None:
                us = getattr(avg, "self_cuda_time_total", 0.0)
            if avg.device_type != torch.autograd.DeviceType.CUDA or not us or avg.key.startswith(("Memset", "Memcpy")):
                continue
            kind = "fetch" if "fetch_lines" in avg.key else "stream" if "stream_read" in avg.key else "gemm"
            totals[kind] += us
        out = {k: v / args.reps for k, v in totals.items()}  # "stream" includes the evicting pre-stream
        return out

    rows = []
    cases = [("cold: stream normal", None, "normal"), ("hot: W loaded, no stream", "load", None)]
    for fm in ("prefetch", "prefetch_evict_last", "load_evict_last", "load"):
        for sm in ("normal", "evict_first"):
            cases.append((f"fetch {fm}, stream {sm}", fm, sm))
    for setaside in ("default", "max"):
        if setaside == "max":
            got = ext.set_persisting(persist_max)
            print(f"persisting set-aside -> {got / 2**20:.1f} MiB")
        for label, fm, sm in cases:
            r = timed(fm, sm, pre_stream=True)
            r.update(case=label, setaside=setaside)
            rows.append(r)
            print(f"{setaside:8s} {label:45s} gemm {r['gemm']:7.2f} us  fetch {r['fetch'] or 0:6.2f}  "
                  f"stream {r['stream'] or 0:7.1f} us ", flush=True)
    ext.reset_persisting()
    ext.set_persisting(0)

    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                l2_bytes=l2, persisting_max_bytes=persist_max, stream_mb=args.stream_mb, rows=args.rows,
                reps=args.reps, fetch_blocks=args.fetch_blocks,
                utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(os.path.join(args.out, "probe_l2_weights.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
