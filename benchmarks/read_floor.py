"""What any kernel that reads a given set of bytes costs at the least, on the GPU.

A decode step's selection and attention are bound by latency long before bandwidth at B = 1, so
"the byte floor at the copy bandwidth" (bytes / copy rate) understates what any kernel can reach.
These helpers measure the floor the way the benchmarks time the real kernels (graph replays of one
launch per layer buffer, ``benchmarks.common.time_graph``), so the two can be compared:

* ``time_empty``: a kernel that writes one word -- the launch and the gap between two kernels of a
  graph, which every launch pays;
* ``time_read``: the best of a few Triton kernels that read one or two buffers once, every 32-bit
  word, and store one sum per program -- no scoring, no gathering, no second phase. Reading the
  same number of bytes contiguously is never slower than gathering them as scattered rows, so this
  bounds from below any kernel that must read them.

Used by ``benchmarks.decode_attention`` (its ``floor-*`` rows). Needs Triton (``available()`` says
whether it imported).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only machine may lack it; only GPU runs call these helpers
    triton = None

# (words per program, warps): the usual fast shapes for a streaming read; the best one is kept.
READ_SHAPES = ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16))

TimeGraph = Callable[[Callable[[int], object], int, int, int], float]


def available() -> bool:
    """Whether Triton imported (the floor kernels are Triton kernels)."""
    return triton is not None


if triton is not None:
    @triton.jit
    def _write_one(out):
        tl.store(out, 1)

    @triton.jit
    def _sum_two(first, first_words, first_programs, second, second_words, out, BLOCK: tl.constexpr):
        # Programs below first_programs read `first`, the others `second`: one launch over both.
        pid = tl.program_id(0).to(tl.int64)
        if pid < first_programs:
            offsets = pid * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(first + offsets, mask=offsets < first_words, other=0)
        else:
            offsets = (pid - first_programs) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(second + offsets, mask=offsets < second_words, other=0)
        tl.store(out + pid, tl.sum(x, axis=0))


def as_words(tensor: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
    """The first `nbytes` bytes (default: all) of a contiguous CUDA tensor, as a flat int32 view.

    Raises ValueError if the tensor is not contiguous, holds fewer bytes, or `nbytes` is not a
    multiple of 4.
    """
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    total = tensor.numel() * tensor.element_size()
    nbytes = total if nbytes is None else nbytes
    if nbytes % 4 or not 0 <= nbytes <= total:
        raise ValueError(f"nbytes must be a multiple of 4 in [0, {total}], got {nbytes}")
    return tensor.reshape(-1).view(torch.uint8)[:nbytes].view(torch.int32)


def time_empty(time_graph: TimeGraph, layers: int, repeats: int, warmup: int = 5) -> float:
    """Median µs of one launch of a kernel that writes one word (graph replays of `layers` launches)."""
    _need_triton()
    sink = torch.zeros(1, device="cuda", dtype=torch.int32)
    return time_graph(lambda i: _write_one[(1,)](sink), layers, repeats, warmup)


def time_read(buffers: Sequence[Sequence[torch.Tensor]], time_graph: TimeGraph, repeats: int,
              warmup: int = 5) -> float:
    """Median µs of the best one-launch read of every word of one layer's buffers.

    buffers[i] holds layer i's one or two flat int32 CUDA tensors (``as_words``); each graph replay
    reads every layer's in turn, one launch per layer, and the time is per layer.
    """
    _need_triton()
    if not buffers or not all(1 <= len(layer) <= 2 for layer in buffers):
        raise ValueError("buffers must hold one or two tensors per layer")
    best = float("inf")
    for block, warps in READ_SHAPES:
        launches = []
        for layer in buffers:
            first, second = (layer[0], layer[1]) if len(layer) == 2 else (layer[0][:0], layer[0])
            first_programs = triton.cdiv(first.numel(), block)
            programs = first_programs + triton.cdiv(second.numel(), block)
            out = torch.empty(max(programs, 1), device="cuda", dtype=torch.int32)
            launches.append((first, first_programs, second, out, programs))

        def launch(i, block=block, warps=warps):
            first, first_programs, second, out, programs = launches[i]
            _sum_two[(programs,)](first, first.numel(), first_programs, second, second.numel(), out,
                                  BLOCK=block, num_warps=warps)

        best = min(best, time_graph(launch, len(buffers), repeats, warmup))
    return best


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("the read floor needs Triton (pip install triton, or torch's CUDA wheels)")
