"""Shared pieces of the encoder tests: random per-head MLPs, strided inputs and the bit check against the float64 reference."""

import torch

from hashattention import reference

# Pre-sign values closer to 0 than this (relative to the layer's output scale) may round
# either way on a given device/dtype; every other bit must match the float64 reference.
MARGIN = {
    ("cpu", torch.float32): 1e-4,
    ("cpu", torch.float16): 1e-4,
    ("cpu", torch.bfloat16): 1e-4,
    ("cuda", torch.float32): 1e-3,
    ("cuda", torch.float16): 1e-3,  # the CUDA encoder also accumulates in float32
    ("cuda", torch.bfloat16): 1e-3,
}


def make_mlp(heads, sizes, generator, dtype, device):
    weights, biases = [], []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = fan_in**-0.5
        weights.append(((torch.rand(heads, fan_in, fan_out, generator=generator) * 2 - 1) * bound).to(dtype))
        biases.append(((torch.rand(heads, fan_out, generator=generator) * 2 - 1) * bound).to(dtype))
    return [w.to(device) for w in weights], [b.to(device) for b in biases]


def check_bits(signatures, pre_sign, margin):
    """Every bit equals (pre_sign > 0) except where |pre_sign| <= margin * scale."""
    assert signatures.shape[:-1] == pre_sign.shape[:-1]
    if pre_sign.numel() == 0:
        return
    expected_bits = pre_sign > 0
    got_bits = reference.unpack_signs(signatures.cpu())
    scale = pre_sign.abs().mean().clamp(min=1e-12)
    uncertain = pre_sign.abs() <= margin * scale
    wrong = (got_bits != expected_bits) & ~uncertain
    assert not wrong.any(), f"{int(wrong.sum())} of {wrong.numel()} bits differ from the float64 reference"
    assert uncertain.float().mean() < 0.02, "margin too loose to test anything"


def at_element_offset(tensor, offset):
    """The same values, stored `offset` elements into a larger buffer (so the data pointer loses its
    16-byte alignment for offsets that are not multiples of 16 bytes)."""
    buffer = torch.zeros(tensor.numel() + offset, dtype=tensor.dtype, device=tensor.device)
    view = buffer[offset:].view(tensor.shape)
    view.copy_(tensor)
    return view


def strided(batch, heads, tokens, dim, generator, dtype, device):
    """A (B, H, N, D) view of a (B, N, H, D) tensor, as an attention layer's queries and keys are."""
    x = torch.randn(batch, tokens, heads, dim, generator=generator).to(dtype).to(device)
    return x.transpose(1, 2)
