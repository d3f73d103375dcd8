"""Shared helpers of the op tests: the devices to run on, seeded inputs, tolerances, CUDA-graph capture."""

import zlib

import torch

import hashattention

DEVICES = ["cpu"]
if torch.cuda.is_available() and hashattention.WITH_CUDA:
    DEVICES.append("cuda")

# Absolute/relative tolerances of attention outputs against the float64 reference, per dtype.
ATTENTION_TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def generator_for(*case) -> torch.Generator:
    """A CPU generator seeded from the test case's parameters: fresh inputs per case, reproducible."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(case).encode()))
    return g


def random_signatures(shape, generator, device="cpu") -> torch.Tensor:
    """Uniformly random int32 words (every bit pattern, sign bit included)."""
    words = torch.randint(-(2**31), 2**31, shape, generator=generator, dtype=torch.int64)
    return words.to(torch.int32).to(device)


def random_lengths(batch, keys, generator, ragged: bool):
    """Per-sequence lengths in [0, keys] (the last one always full) and start offsets in [0, length]."""
    if not ragged:
        return torch.full((batch,), keys, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32)
    lengths = torch.randint(0, keys + 1, (batch,), generator=generator)
    lengths[-1] = keys
    starts = (torch.rand(batch, generator=generator) * (lengths + 1).float()).floor().long().clamp(max=lengths)
    return lengths.to(torch.int32), starts.to(torch.int32)


def assert_close_verbose(actual, expected, *, what="", **tolerance):
    """torch.testing.assert_close with the worst element named in the message."""
    actual64 = actual.double().cpu()
    expected64 = expected.double().cpu()
    try:
        torch.testing.assert_close(actual64, expected64, equal_nan=False, **tolerance)
    except AssertionError as error:
        diff = (actual64 - expected64).abs().nan_to_num(float("inf"))
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: worst element {worst}: got {actual64[worst].item()}, expected {expected64[worst].item()}\n{error}"
        ) from None


def capture_cuda_graph(fn):
    """Warm up `fn` on a side stream, capture it in a CUDA graph; returns (graph, static outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
