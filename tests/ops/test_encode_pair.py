"""encode_signatures_pair: a decode step's query and key encodes in one call.

It must equal the float64 reference and, bit for bit, two encode_signatures calls (the key
repeated onto the key MLP heads), on every shape the fused CUDA launch and its fallbacks see.
"""

import pytest
import torch

import hashattention as ha
from hashattention import reference
from op_helpers import generator_for
from encoder_helpers import MARGIN, check_bits, make_mlp, strided


def two_calls(query, qw, qb, key, kw, kb, activation):
    """What the pair replaces: two encode_signatures calls, the key repeated onto the key MLP heads."""
    expanded = key.repeat_interleave(kw[0].shape[0] // key.shape[1], dim=1)
    return ha.encode_signatures(query, qw, qb, activation), ha.encode_signatures(expanded, kw, kb, activation)


def check_pair(query, qw, qb, key, kw, kb, activation, margin):
    q_sig, k_sig = ha.encode_signatures_pair(query, qw, qb, key, kw, kb, activation)
    batch, key_batch = query.shape[0], key.shape[0]
    assert q_sig.shape == (batch, qw[0].shape[0], query.shape[2], qw[-1].shape[-1] // 32)
    assert k_sig.shape == (key_batch, kw[0].shape[0], key.shape[2], kw[-1].shape[-1] // 32)
    assert q_sig.dtype == k_sig.dtype == torch.int32 and q_sig.device == k_sig.device == query.device
    # Bit for bit what the two separate calls give (same arithmetic on every path).
    want_q, want_k = two_calls(query, qw, qb, key, kw, kb, activation)
    assert torch.equal(q_sig, want_q), "query signatures differ from encode_signatures"
    assert torch.equal(k_sig, want_k), "key signatures differ from encode_signatures of the repeated keys"
    # And the float64 reference, up to values within rounding of 0.
    cpu = lambda ts: [t.cpu() for t in ts]  # noqa: E731
    expanded = key.cpu().repeat_interleave(kw[0].shape[0] // key.shape[1], dim=1)
    check_bits(q_sig, reference.mlp_outputs(query.cpu(), cpu(qw), cpu(qb), activation), margin)
    check_bits(k_sig, reference.mlp_outputs(expanded, cpu(kw), cpu(kb), activation), margin)
    ref_q, ref_k = reference.encode_signatures_pair(query.cpu(), cpu(qw), cpu(qb), key.cpu(), cpu(kw), cpu(kb), activation)
    assert ref_q.shape == q_sig.shape and ref_k.shape == k_sig.shape


# (batch, query heads, query rows, key MLP heads, key heads, key rows, query D, key D, hidden, bits)
SHAPES = [
    (1, 8, 1, 8, 2, 1, 64, 64, (64,), 32),  # decode step, per-query-head key MLPs over KV-head keys
    (4, 8, 1, 8, 8, 1, 128, 128, (128, 128), 32),  # Hx = Hk, the paper's MLP, batch 4
    (2, 4, 1, 4, 4, 1, 64, 64, (32,), 64),  # two words
    (2, 8, 1, 8, 1, 3, 64, 64, (32,), 64),  # one KV head (MQA), a 3-key chunk
    (3, 6, 2, 3, 3, 5, 64, 128, (32,), 32),  # group-shared key MLPs; different N, D and batch rows per head
    (1, 4, 3, 4, 2, 70, 64, 64, (32,), 32),  # 70 key rows: on CUDA the key takes cuBLAS, the query the fused kernel
    (2, 2, 40, 4, 2, 1, 64, 64, (32,), 32),  # 80 query rows: cuBLAS for the query, fused for the key
    (1, 4, 1, 4, 2, 0, 64, 64, (32,), 32),  # an empty key chunk
    (2, 4, 9, 4, 2, 9, 64, 64, (96,), 32),  # 18 rows per head: several row blocks in one launch
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_pair_matches_reference_and_two_calls(device, dtype, shape):
    batch, hq, lq, hk, hx, nk, dq, dk, hidden, bits = shape
    g = generator_for("pair", device, dtype, shape)
    query = strided(batch, hq, lq, dq, g, dtype, device)
    key = strided(batch, hx, nk, dk, g, dtype, device)
    qw, qb = make_mlp(hq, [dq, *hidden, bits], g, dtype, device)
    kw, kb = make_mlp(hk, [dk, *hidden, bits], g, dtype, device)
    check_pair(query, qw, qb, key, kw, kb, "silu", MARGIN[(device, dtype)])


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", "identity"])
def test_pair_activations(device, activation):
    g = generator_for("pair-activation", device, activation)
    query = strided(2, 4, 1, 64, g, torch.float32, device)
    key = strided(2, 2, 1, 64, g, torch.float32, device)
    qw, qb = make_mlp(4, [64, 64, 32], g, torch.bfloat16, device)
    kw, kb = make_mlp(4, [64, 64, 32], g, torch.bfloat16, device)
    check_pair(query, qw, qb, key, kw, kb, activation, MARGIN[(device, torch.float32)])


@pytest.mark.parametrize(
    "query_dtype,key_dtype,query_weight_dtype,key_weight_dtype",
    [
        (torch.float32, torch.bfloat16, torch.float32, torch.float32),  # x dtypes differ: two launches on CUDA
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float16),  # weight dtypes differ: two launches
        (torch.float16, torch.float16, torch.float32, torch.float32),  # weights in another dtype than x: one launch
    ],
)
def test_pair_with_mixed_dtypes(device, query_dtype, key_dtype, query_weight_dtype, key_weight_dtype):
    g = generator_for("pair-dtypes", device, query_dtype, key_dtype, query_weight_dtype, key_weight_dtype)
    query = strided(1, 8, 1, 64, g, query_dtype, device)
    key = strided(1, 2, 1, 64, g, key_dtype, device)
    qw, qb = make_mlp(8, [64, 32, 32], g, query_weight_dtype, device)
    kw, kb = make_mlp(8, [64, 32, 32], g, key_weight_dtype, device)
    check_pair(query, qw, qb, key, kw, kb, "silu", max(MARGIN[(device, query_dtype)], MARGIN[(device, key_dtype)]))


def test_pair_with_large_key_mlp(device):
    """Query and key stacks of different sizes in one launch: the key's weights (a 1024-wide layer,
    staged in tiles) need more shared memory than the query's (staged at once)."""
    g = generator_for("pair-sizes", device)
    query = strided(2, 4, 1, 64, g, torch.float32, device)
    key = strided(2, 2, 1, 256, g, torch.float32, device)
    qw, qb = make_mlp(4, [64, 32, 32], g, torch.float32, device)
    kw, kb = make_mlp(4, [256, 1024, 64], g, torch.float32, device)
    check_pair(query, qw, qb, key, kw, kb, "silu", MARGIN[(device, torch.float32)])


def test_pair_adapter_decode_signatures_equals_separate_calls(device):
    """LayerAdapter.decode_signatures == (query_signatures, key_signatures), both key-head modes."""
    from hashattention.adapters import AdapterConfig, LayerAdapter

    g = generator_for("pair-adapter", device)
    for key_heads in ("query", "kv"):
        torch.manual_seed(3)
        config = AdapterConfig(num_layers=1, num_query_heads=8, num_kv_heads=2, head_dim=64, key_heads=key_heads,
                               hidden_features=(32,))
        adapter = LayerAdapter(config).to(device)
        query = strided(2, 8, 1, 64, g, torch.float32, device)
        key = strided(2, 2, 1, 64, g, torch.float32, device)
        q_sig, k_sig = adapter.decode_signatures(query, key)
        assert k_sig.shape == (2, config.num_key_signature_heads, 1, 1)
        assert torch.equal(q_sig, adapter.query_signatures(query))
        assert torch.equal(k_sig, adapter.key_signatures(key))


def pair_args(**overrides):
    """Valid arguments (decode step, 4 query heads over 2 KV heads), with some replaced."""
    args = dict(
        query=torch.randn(1, 4, 1, 64),
        query_weights=[torch.randn(4, 64, 32), torch.randn(4, 32, 32)],
        query_biases=[torch.randn(4, 32), torch.randn(4, 32)],
        key=torch.randn(1, 2, 1, 64),
        key_weights=[torch.randn(4, 64, 32), torch.randn(4, 32, 32)],
        key_biases=[torch.randn(4, 32), torch.randn(4, 32)],
    )
    args.update(overrides)
    return args


BAD_INPUTS = [
    ("key heads do not divide", dict(key=torch.randn(1, 3, 1, 64)), ValueError,
     r"key heads \(3\) must divide key_weights\[0\] heads \(4\)"),
    ("more key heads than MLP heads", dict(key=torch.randn(1, 8, 1, 64)), ValueError,
     r"key heads \(8\) must divide key_weights\[0\] heads \(4\)"),
    ("key head_dim mismatch", dict(key=torch.randn(1, 2, 1, 32)), ValueError,
     r"key_weights\[0\] must have in_features = 32 \(the last dimension of key\)"),
    ("query head_dim mismatch", dict(query=torch.randn(1, 4, 1, 128)), ValueError,
     r"query_weights\[0\] must have in_features = 128 \(the last dimension of query\)"),
    ("query heads mismatch", dict(query=torch.randn(1, 2, 1, 64)), ValueError,
     r"query_weights\[0\] must have one matrix per head \(2 heads in query\)"),
    ("key layers disagree on heads", dict(key_weights=[torch.randn(4, 64, 32), torch.randn(2, 32, 32)]), ValueError,
     r"key_weights\[1\] must have one matrix per head \(4 heads in key_weights\[0\]\)"),
    ("key bias shape", dict(key_biases=[torch.randn(4, 32), torch.randn(2, 32)]), ValueError,
     r"key_biases\[1\] must have shape \(heads, out_features\) = \(4, 32\)"),
    ("integer query", dict(query=torch.ones(1, 4, 1, 64, dtype=torch.int32)), TypeError,
     "query must be float32, float16 or bfloat16, got Int"),
    ("float64 key", dict(key=torch.randn(1, 2, 1, 64, dtype=torch.float64)), TypeError,
     "key must be float32, float16 or bfloat16, got Double"),
    ("integer key weights", dict(key_weights=[torch.ones(4, 64, 32, dtype=torch.int64), torch.randn(4, 32, 32)]),
     TypeError, r"key_weights\[0\] must be float32, float16 or bfloat16"),
    ("key bits not a multiple of 32", dict(key_weights=[torch.randn(4, 64, 48)], key_biases=[torch.randn(4, 48)]),
     ValueError, "out_features in key_weights .* multiple of 32, got 48"),
    ("no key layers", dict(key_weights=[], key_biases=[]), ValueError, "key_weights must hold at least one layer"),
    ("layer counts differ", dict(query_biases=[torch.randn(4, 32)]), ValueError,
     "query_weights and query_biases must have one entry per layer, got 2 query_weights and 1 query_biases"),
    ("key with 3 dimensions", dict(key=torch.randn(2, 1, 64)), ValueError, "key must have 4 dimensions"),
    ("empty batch", dict(key=torch.randn(0, 2, 1, 64)), ValueError, "key has an empty batch"),
]


@pytest.mark.parametrize("description,overrides,error,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_pair_rejects_bad_input(device, description, overrides, error, message):
    args = {name: ([t.to(device) for t in value] if isinstance(value, list) else value.to(device))
            for name, value in pair_args(**overrides).items()}
    with pytest.raises(error, match=message):
        ha.encode_signatures_pair(**args)


def test_pair_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation must be one of"):
        ha.encode_signatures_pair(**pair_args(), activation="swish")


@pytest.mark.skipif(not (torch.cuda.is_available() and ha.WITH_CUDA), reason="needs a CUDA device")
def test_pair_rejects_key_on_another_device():
    args = pair_args()
    args["query"] = args["query"].cuda()
    args["query_weights"] = [t.cuda() for t in args["query_weights"]]
    args["query_biases"] = [t.cuda() for t in args["query_biases"]]
    with pytest.raises(ValueError, match="key is on cpu but query is on cuda"):
        ha.encode_signatures_pair(**args)
