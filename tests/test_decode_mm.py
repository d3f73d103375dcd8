"""decode_mm against a float64 product: the CUDA kernel's shapes (M <= 8 rows, frozen-weight layout, bf16 /
fp16) and every shape it hands to torch.mm, plus its argument errors."""

import pytest
import torch

from conftest import generator_for
from hashattention import ops

# |error| / max |a @ b| per dtype: the kernel accumulates in float32 and rounds once.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def frozen_weight(k, n, dtype, device, g):
    """(k, n) column-major, as a frozen nn.Linear(k, n) weight reaches the GEMM."""
    return torch.randn(n, k, generator=g).to(device, dtype).t()


def check(product, a, b):
    reference = a.double() @ b.double()
    assert product.shape == reference.shape and product.dtype == a.dtype and product.device == a.device
    assert torch.isfinite(product).all(), "an output element was not written (poisoned NaN left)"
    error = (product.double() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)
    assert error <= TOLERANCE[a.dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k, n", [(8, 1), (64, 40), (256, 33), (1032, 517), (4096, 1024), (4104, 2050)])
def test_kernel_shapes(device, dtype, rows, k, n):
    """M <= 8, K a multiple of 8: the kernel's path on CUDA (K shorter than a stage, between stages, N
    not a multiple of any rows-per-warp)."""
    g = generator_for(f"decode_mm {rows} {k} {n}", device)
    a = torch.randn(rows, k, generator=g).to(device, dtype)
    b = frozen_weight(k, n, dtype, device, g)
    check(ops.decode_mm(a, b), a, b)


@pytest.mark.parametrize("case", ["row_major_b", "rows_9", "k_not_multiple_of_8", "float32", "strided_a",
                                  "padded_weight", "empty_k", "unaligned_a"])
def test_fallback_and_strided_shapes(device, case):
    """Inputs the kernel does not take go to torch.mm; a padded weight (row stride > K) and a row-strided a
    are the kernel's again. Either way the product is right."""
    g = generator_for(f"decode_mm {case}", device)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    rows, k, n = (9 if case == "rows_9" else 4), (100 if case == "k_not_multiple_of_8" else 128), 72
    if case == "empty_k":
        k = 0
    a = torch.randn(rows, k, generator=g).to(device, dtype)
    b = frozen_weight(k, n, dtype, device, g)
    if case == "row_major_b":
        b = b.contiguous()
    if case == "strided_a":
        a = torch.randn(rows, 2 * k, generator=g).to(device, dtype)[:, :k]
    if case == "padded_weight":
        b = torch.randn(n, k + 16, generator=g).to(device, dtype)[:, :k].t()
    if case == "unaligned_a":
        a = torch.randn(rows * k + 1, generator=g).to(device, dtype)[1:].view(rows, k)
    if case == "empty_k":
        assert (ops.decode_mm(a, b) == 0).all()
        return
    check(ops.decode_mm(a, b), a, b)


def test_bad_arguments(device):
    a = torch.randn(2, 16, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="agree in K"):
        ops.decode_mm(a, torch.randn(8, 4, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"b must have 2 dimensions"):
        ops.decode_mm(a, torch.randn(16, device=device, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="b must have a's dtype"):
        ops.decode_mm(a, torch.randn(16, 4, device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.decode_mm(a.to(torch.int32), torch.randn(16, 4, device=device).to(torch.int32))
