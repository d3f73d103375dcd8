"""encode_signatures and pack_signs against the float64 reference."""

import pytest
import torch

import hashattention as ha
from hashattention import reference
from op_helpers import generator_for
from encoder_helpers import MARGIN, at_element_offset, check_bits, make_mlp

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,heads,tokens,dim,hidden,bits",
    [
        (1, 4, 1, 64, (64,), 32),
        (3, 9, 37, 64, (128, 128), 32),
        (2, 8, 300, 128, (128, 128), 64),
        (1, 2, 0, 128, (32,), 32),  # an empty cache
        (2, 3, 5, 64, (), 96),  # a single linear layer, three words
    ],
)
@pytest.mark.parametrize("activation", ["silu", "relu", "gelu", "tanh", "identity"])
def test_encode_matches_reference(device, dtype, batch, heads, tokens, dim, hidden, bits, activation):
    g = generator_for("encode", device, dtype, batch, heads, tokens, dim, hidden, bits, activation)
    x = torch.randn(batch, heads, tokens, dim, generator=g).to(dtype).to(device)
    weights, biases = make_mlp(heads, [dim, *hidden, bits], g, dtype, device)
    signatures = ha.encode_signatures(x, weights, biases, activation)
    assert signatures.shape == (batch, heads, tokens, bits // 32)
    assert signatures.dtype == torch.int32 and signatures.device.type == device
    pre_sign = reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases], activation)
    check_bits(signatures, pre_sign, MARGIN[(device, dtype)])


def test_encode_accepts_weights_in_another_dtype(device):
    g = generator_for("encode-mixed", device)
    x = torch.randn(2, 4, 10, 64, generator=g).to(device)
    weights, biases = make_mlp(4, [64, 32, 32], g, torch.bfloat16, device)
    pre_sign = reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases])
    check_bits(ha.encode_signatures(x, weights, biases), pre_sign, MARGIN[(device, torch.float32)])


def test_encode_non_contiguous_input(device):
    g = generator_for("encode-strided", device)
    x = torch.randn(2, 20, 4, 64, generator=g).to(device).transpose(1, 2)  # (B, H, N, D) view
    weights, biases = make_mlp(4, [64, 64, 32], g, torch.float32, device)
    pre_sign = reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases])
    check_bits(ha.encode_signatures(x, weights, biases), pre_sign, MARGIN[(device, torch.float32)])


# On CUDA, up to 64 rows per head (batch * tokens) run through one fused kernel, in blocks of 8
# rows, with layers up to 1024 wide and one weight dtype; anything else takes the cuBLAS path.
# Weights are staged all at once up to ~200 KB of shared memory per block, else in 64 KB tiles.
# These shapes sit on both sides of each of those limits.
@pytest.mark.parametrize(
    "batch,tokens,sizes,weight_dtype",
    [
        (1, 1, (128, 128, 32), torch.bfloat16),  # a decode step of the shipped layout
        (4, 1, (128, 128, 32), torch.bfloat16),
        (1, 1, (128, 128, 128, 32), torch.bfloat16),  # the paper's MLP: 72 KB, every layer staged at once
        (4, 1, (128, 128, 128, 32), torch.float32),  # 144 KB: still at once (more than one 64 KB tile)
        (2, 1, (33, 41, 32), torch.float16),  # per-head weights not 16-byte aligned: element copies
        (3, 3, (64, 96, 64), torch.float32),  # 9 rows: a second block of rows, a partial one
        (8, 8, (64, 128, 32), torch.float16),  # 64 rows: the last fused size
        (5, 13, (64, 128, 32), torch.float16),  # 65 rows: cuBLAS
        (2, 1, (256, 1024, 64), torch.float32),  # the widest fused layer, a wider input
        (2, 1, (64, 1025, 32), torch.float32),  # too wide: cuBLAS
        (1, 2, (64,) + (40,) * 8 + (32,), torch.float32),  # 9 layers: cuBLAS
        (1, 2, (64,) + (40,) * 7 + (32,), torch.float32),  # 8 layers: fused
    ],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu", "tanh"])
def test_encode_few_rows_matches_reference(device, batch, tokens, sizes, weight_dtype, x_dtype, activation):
    heads = 3
    g = generator_for("encode-few", device, batch, tokens, sizes, weight_dtype, x_dtype, activation)
    # A strided (B, H, N, D) view, as the query of an attention layer: (B, N, H, D) transposed.
    x = torch.randn(batch, tokens, heads, sizes[0], generator=g).to(x_dtype).to(device).transpose(1, 2)
    weights, biases = make_mlp(heads, list(sizes), g, weight_dtype, device)
    signatures = ha.encode_signatures(x, weights, biases, activation)
    assert signatures.shape == (batch, heads, tokens, sizes[-1] // 32)
    pre_sign = reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases], activation)
    check_bits(signatures, pre_sign, MARGIN[(device, x_dtype)])


# The fused CUDA kernel stages a layer's weights and bias by bulk copy only when both start on a
# 16-byte boundary and span whole 16-byte units; otherwise it falls back to cp.async or element
# copies for the whole block. Misalign the weights, the biases, or one layer's pair only.
@pytest.mark.parametrize("misaligned", ["weights", "biases", "second-layer", "none"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_encode_weights_at_unaligned_addresses(device, misaligned, weight_dtype):
    g = generator_for("encode-unaligned", device, misaligned, weight_dtype)
    x = torch.randn(2, 4, 1, 64, generator=g).to(torch.bfloat16).to(device)
    weights, biases = make_mlp(4, [64, 128, 64, 32], g, weight_dtype, device)
    for i in range(len(weights)):
        if misaligned in ("weights", "biases") or (misaligned == "second-layer" and i == 1):
            if misaligned != "biases":
                weights[i] = at_element_offset(weights[i], 1)
            if misaligned != "weights":
                biases[i] = at_element_offset(biases[i], 3)
    pre_sign = reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases])
    check_bits(ha.encode_signatures(x, weights, biases), pre_sign, MARGIN[(device, torch.bfloat16)])
    # The decode step's pair launch: the key problem's weights misaligned, the query's not.
    key = torch.randn(2, 2, 1, 64, generator=g).to(torch.bfloat16).to(device)
    query_weights, query_biases = make_mlp(4, [64, 128, 64, 32], g, weight_dtype, device)
    got_query, got_key = ha.encode_signatures_pair(x, query_weights, query_biases, key, weights, biases)
    check_bits(got_query, reference.mlp_outputs(x.cpu(), [w.cpu() for w in query_weights],
                                                [b.cpu() for b in query_biases]), MARGIN[(device, torch.bfloat16)])
    key_rows = key.cpu().repeat_interleave(2, dim=1)  # per-query-head MLPs read KV head h // 2
    check_bits(got_key, reference.mlp_outputs(key_rows, [w.cpu() for w in weights], [b.cpu() for b in biases]),
               MARGIN[(device, torch.bfloat16)])


# bf16 weights at decode sizes run on tensor cores (encode_mma.cu) when every width is a multiple of
# 16 up to 256 and a head has 5 to 16 rows (batch * tokens); the rest stays on the float32 kernel.
# These shapes sit on both sides of each limit, and each runs under the automatic choice and under
# each kernel forced (HASHATTENTION_ENCODER=fma / mma / cluster2 / cluster4; "mma" also takes 1-4
# rows, the cluster kernels take power-of-two widths up to 256 with x in the weights' dtype and
# leave the rest to the automatic choice; on the CPU the variable means nothing).
@pytest.mark.parametrize(
    "batch,tokens,sizes",
    [
        (4, 4, (128, 128, 128, 32)),  # 16 rows: the tensor-core limit, the paper's MLP
        (5, 1, (128, 128, 32)),  # 5 rows: the fewest the automatic choice puts on tensor cores
        (4, 1, (128, 128, 32)),  # 4 rows: the float32 kernel unless forced
        (17, 1, (128, 128, 32)),  # 17 rows: the float32 kernel
        (3, 2, (256, 256, 64)),  # the widest tensor-core layer, two words
        (2, 3, (128, 272, 32)),  # too wide: the float32 kernel
        (3, 3, (64, 120, 32)),  # a width that is not a multiple of 16: the float32 kernel
        (5, 2, (16, 96)),  # one layer, three words
        (1, 1, (128, 128, 128, 32)),  # one row (a batch-1 decode step)
    ],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["auto", "fma", "mma", "cluster2", "cluster4"])
def test_encode_bf16_weights_on_both_kernels(device, monkeypatch, batch, tokens, sizes, x_dtype, kernel):
    if device == "cpu" and kernel != "auto":
        pytest.skip("HASHATTENTION_ENCODER chooses between CUDA kernels")
    if kernel != "auto":
        monkeypatch.setenv("HASHATTENTION_ENCODER", kernel)
    heads = 3
    g = generator_for("encode-bf16-kernels", device, batch, tokens, sizes, x_dtype)
    # Inputs of a few units' magnitude, so that a float32 x needs both bf16 halves to stay exact enough.
    x = (3 * torch.randn(batch, tokens, heads, sizes[0], generator=g)).to(x_dtype).to(device).transpose(1, 2)
    weights, biases = make_mlp(heads, list(sizes), g, torch.bfloat16, device)
    signatures = ha.encode_signatures(x, weights, biases, "silu")
    assert signatures.shape == (batch, heads, tokens, sizes[-1] // 32)
    pre_sign = reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases], "silu")
    check_bits(signatures, pre_sign, MARGIN[(device, x_dtype)])


def test_encode_rejects_unknown_kernel_choice(device, monkeypatch):
    if device == "cpu":
        pytest.skip("HASHATTENTION_ENCODER chooses between CUDA kernels")
    monkeypatch.setenv("HASHATTENTION_ENCODER", "tensor")
    g = generator_for("encode-kernel-choice", device)
    x = torch.randn(1, 2, 1, 64, generator=g).to(torch.bfloat16).to(device)
    weights, biases = make_mlp(2, [64, 32], g, torch.bfloat16, device)
    expected = r"HASHATTENTION_ENCODER must be fma, mma, cluster2, cluster4 or skip, got 'tensor'"
    with pytest.raises(RuntimeError, match=expected):
        ha.encode_signatures(x, weights, biases)


def test_encode_mixed_weight_dtypes(device):
    """Layers in different dtypes (the fused CUDA kernel takes one dtype) still encode correctly."""
    g = generator_for("encode-mixed-layers", device)
    x = torch.randn(2, 4, 1, 64, generator=g).to(device)
    w0, b0 = make_mlp(4, [64, 128], g, torch.float32, device)
    w1, b1 = make_mlp(4, [128, 32], g, torch.bfloat16, device)
    weights, biases = w0 + w1, b0 + b1
    pre_sign = reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases])
    check_bits(ha.encode_signatures(x, weights, biases), pre_sign, MARGIN[(device, torch.float32)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(64,), (3, 32), (2, 5, 7, 128), (0, 32)])
def test_pack_signs_matches_reference(device, dtype, shape):
    g = generator_for("pack", device, dtype, shape)
    values = torch.randn(shape, generator=g).to(dtype)
    values.view(-1)[::7] = 0.0  # zero must give bit 0
    packed = ha.pack_signs(values.to(device))
    assert packed.shape == (*shape[:-1], shape[-1] // 32) and packed.dtype == torch.int32
    assert torch.equal(packed.cpu(), reference.pack_signs(values))


def test_pack_signs_bit_order(device):
    values = -torch.ones(2, 64)
    values[0, 0] = 1.0  # word 0, bit 0
    values[0, 31] = 1.0  # word 0, bit 31 (the int32 sign bit)
    values[1, 32 + 5] = 1.0  # word 1, bit 5
    packed = ha.pack_signs(values.to(device)).cpu()
    assert packed[0].tolist() == [1 - 2**31, 0]
    assert packed[1].tolist() == [0, 1 << 5]


def test_pack_signs_nan_gives_zero(device):
    values = torch.full((32,), float("nan"))
    assert ha.pack_signs(values.to(device)).item() == 0


@pytest.mark.parametrize("activation", ["silu", "relu", "gelu", "tanh", "identity"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (4, 4), (3, 30)])  # on CUDA: decode-step kernels, then cuBLAS
@pytest.mark.parametrize("kernel", ["auto", "fma", "mma", "cluster2", "cluster4"])
def test_encode_nan_row_gives_zero_bits(device, monkeypatch, activation, batch, tokens, kernel):
    """A NaN in a row makes every MLP output of that row NaN (every activation keeps NaN, as torch's
    do), and a NaN gets bit 0 (as in pack_signs): the same all-zero signature on every device and
    kernel, alone and in the pair launch; the other rows keep their signatures."""
    if device == "cpu" and kernel != "auto":
        pytest.skip("HASHATTENTION_ENCODER chooses between CUDA kernels")
    if kernel != "auto":
        monkeypatch.setenv("HASHATTENTION_ENCODER", kernel)
    heads, sizes = 3, (128, 128, 32)
    g = generator_for("encode-nan", device, activation, batch, tokens, kernel)
    x = torch.randn(batch, heads, tokens, sizes[0], generator=g).to(torch.bfloat16).to(device)
    weights, biases = make_mlp(heads, list(sizes), g, torch.bfloat16, device)
    expected = ha.encode_signatures(x, weights, biases, activation).cpu()
    x[0, 1, tokens - 1, 5] = float("nan")
    expected[0, 1, tokens - 1] = 0
    cpu_weights, cpu_biases = [w.cpu() for w in weights], [b.cpu() for b in biases]
    assert torch.equal(reference.encode_signatures(x.cpu(), cpu_weights, cpu_biases, activation)[0, 1, tokens - 1],
                       expected[0, 1, tokens - 1])
    assert torch.equal(ha.encode_signatures(x, weights, biases, activation).cpu(), expected)
    pair = ha.encode_signatures_pair(x, weights, biases, x, weights, biases, activation)
    assert torch.equal(pair[0].cpu(), expected) and torch.equal(pair[1].cpu(), expected)
