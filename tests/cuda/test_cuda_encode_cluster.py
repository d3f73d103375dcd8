"""The few-rows encoder split over thread-block clusters (the automatic choice up to 4 rows per head;
forced everywhere it applies by HASHATTENTION_ENCODER=cluster2 / cluster4).

Each head's MLP runs on 2 or 4 blocks that each own a share of every layer's inputs and add their
partial sums through distributed shared memory. Its signatures must match the float64 reference on
every shape it takes (row counts around its 1 / 2 / 4 / 8-row blocks, several row groups, widths
down to the cluster size, two-word outputs, unaligned weights that it stages element by element),
the pair launch must equal two single launches bit for bit, and shapes it does not take must fall
back to the other kernels with the right result. CUDA only (sm_90 clusters)."""

import pytest
import torch

import hashattention as ha
from hashattention import reference
from op_helpers import generator_for
from encoder_helpers import MARGIN, at_element_offset, check_bits, make_mlp, strided

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="thread-block clusters: sm_90")


def reference_bits(x, weights, biases, activation="silu"):
    return reference.mlp_outputs(x.cpu(), [w.cpu() for w in weights], [b.cpu() for b in biases], activation)


# (batch, tokens, sizes): rows per head = batch * tokens
SHAPES = [
    (1, 1, (128, 128, 128, 32)),  # a batch-1 decode step, the paper's MLP
    (4, 1, (128, 128, 128, 32)),  # batch 4: one 4-row block per cluster
    (3, 1, (128, 128, 128, 32)),  # 3 rows in a 4-row block
    (2, 1, (64, 64, 32)),
    (5, 1, (128, 128, 32)),  # 5 rows: an 8-row block
    (3, 3, (128, 128, 32)),  # 9 rows: two row groups
    (8, 8, (128, 128, 128, 32)),  # 64 rows: the most it takes, eight row groups
    (2, 1, (128, 256, 64)),  # the widest layer, two words
    (2, 1, (8, 4, 32)),  # widths down to the cluster size (4 units: one per block of 4)
    (1, 2, (256, 32)),  # a single layer
    (2, 1, (128, 16, 16, 32)),  # hidden layers narrower than a warp
]


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("kernel", ["cluster2", "cluster4"])
def test_cluster_matches_reference(monkeypatch, kernel, shape, dtype, activation):
    monkeypatch.setenv("HASHATTENTION_ENCODER", kernel)
    batch, tokens, sizes = shape
    heads = 5
    g = generator_for("encode-cluster", kernel, shape, dtype, activation)
    x = strided(batch, heads, tokens, sizes[0], g, dtype, "cuda")
    weights, biases = make_mlp(heads, list(sizes), g, dtype, "cuda")
    signatures = ha.encode_signatures(x, weights, biases, activation)
    assert signatures.shape == (batch, heads, tokens, sizes[-1] // 32)
    check_bits(signatures, reference_bits(x, weights, biases, activation), MARGIN[("cuda", dtype)])


@pytest.mark.parametrize("batch", [1, 4, 6, 16])
@pytest.mark.parametrize("kernel", ["cluster2", "cluster4"])
def test_cluster_pair_equals_two_launches(monkeypatch, kernel, batch):
    """A decode step: per-query-head key MLPs over KV-head keys, query and key problems in one launch."""
    monkeypatch.setenv("HASHATTENTION_ENCODER", kernel)
    g = generator_for("encode-cluster-pair", kernel, batch)
    query = strided(batch, 8, 1, 128, g, torch.bfloat16, "cuda")
    key = strided(batch, 2, 1, 128, g, torch.bfloat16, "cuda")
    qw, qb = make_mlp(8, [128, 128, 128, 32], g, torch.bfloat16, "cuda")
    kw, kb = make_mlp(8, [128, 128, 128, 32], g, torch.bfloat16, "cuda")
    q_sig, k_sig = ha.encode_signatures_pair(query, qw, qb, key, kw, kb)
    expanded = key.repeat_interleave(4, dim=1)
    assert torch.equal(q_sig, ha.encode_signatures(query, qw, qb))
    assert torch.equal(k_sig, ha.encode_signatures(expanded, kw, kb))
    check_bits(q_sig, reference_bits(query, qw, qb), MARGIN[("cuda", torch.bfloat16)])
    check_bits(k_sig, reference_bits(expanded, kw, kb), MARGIN[("cuda", torch.bfloat16)])


@pytest.mark.parametrize("misaligned", ["weights", "biases"])
def test_cluster_unaligned_weights(monkeypatch, misaligned):
    """Weights or biases off a 16-byte boundary: staged element by element instead of by bulk copy."""
    monkeypatch.setenv("HASHATTENTION_ENCODER", "cluster4")
    g = generator_for("encode-cluster-unaligned", misaligned)
    x = strided(4, 3, 1, 128, g, torch.bfloat16, "cuda")
    weights, biases = make_mlp(3, [128, 128, 32], g, torch.bfloat16, "cuda")
    if misaligned == "weights":
        weights = [at_element_offset(w, 1) for w in weights]
    else:
        biases = [at_element_offset(b, 3) for b in biases]
    check_bits(ha.encode_signatures(x, weights, biases), reference_bits(x, weights, biases),
               MARGIN[("cuda", torch.bfloat16)])


@pytest.mark.parametrize(
    "sizes,x_dtype,weight_dtype",
    [
        ((128, 96, 32), torch.bfloat16, torch.bfloat16),  # a width that is not a power of two
        ((128, 512, 32), torch.bfloat16, torch.bfloat16),  # wider than 256
        ((128, 2, 32), torch.bfloat16, torch.bfloat16),  # a hidden width below the cluster size
        ((128, 128, 32), torch.float32, torch.bfloat16),  # x in another dtype
        ((128, 128, 32), torch.float32, torch.float32),  # float32 weights
        ((6, 128, 32), torch.bfloat16, torch.bfloat16),  # inputs not divisible by the cluster
    ],
)
def test_cluster_falls_back_where_it_does_not_apply(monkeypatch, sizes, x_dtype, weight_dtype):
    monkeypatch.setenv("HASHATTENTION_ENCODER", "cluster4")
    g = generator_for("encode-cluster-fallback", sizes, x_dtype, weight_dtype)
    x = strided(4, 3, 1, sizes[0], g, x_dtype, "cuda")
    weights, biases = make_mlp(3, list(sizes), g, weight_dtype, "cuda")
    check_bits(ha.encode_signatures(x, weights, biases), reference_bits(x, weights, biases), MARGIN[("cuda", x_dtype)])
