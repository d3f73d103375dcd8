"""encode_signatures_pair_into: the pair with the key signatures stored into a signature cache.

The returned query signatures and the cache rows it writes must equal encode_signatures_pair's two
outputs bit for bit (which test_encode_pair checks against the float64 reference), every other
cache row must keep its old value, on every cache layout and on each CUDA kernel (fused float32,
tensor cores, clusters of 2 or 4 blocks per head, cuBLAS + row store).
"""

import pytest
import torch

import hashattention as ha
from op_helpers import generator_for, random_signatures
from encoder_helpers import make_mlp, strided
from test_encode_pair import SHAPES


def cache_buffer(layout, batch, heads, slots, words, generator, device):
    """A (B, H, S, W) int32 cache of random words: contiguous, with padded slots, or slot-major."""
    if layout == "contiguous":
        return random_signatures((batch, heads, slots, words), generator, device)
    if layout == "padded":  # rows of W + 1 words, as a 16-byte aligned buffer would pad them
        return random_signatures((batch, heads, slots, words + 1), generator, device)[..., :words]
    return random_signatures((batch, slots, heads, words), generator, device).transpose(1, 2)  # "slot-major"


def check_into(query, qw, qb, key, kw, kb, layout, generator, activation="silu"):
    batch, tokens = key.shape[0], key.shape[2]
    words = kw[-1].shape[-1] // 32
    slots = tokens + 7
    cache = cache_buffer(layout, batch, kw[0].shape[0], slots, words, generator, key.device)
    positions = torch.randperm(slots, generator=generator)[:tokens].to(key.device)
    before = cache.clone()
    got_q = ha.encode_signatures_pair_into(query, qw, qb, key, kw, kb, cache, positions, activation)
    want_q, want_k = ha.encode_signatures_pair(query, qw, qb, key, kw, kb, activation)
    assert got_q.dtype == torch.int32 and torch.equal(got_q, want_q), "query signatures differ from the pair's"
    expected = before.clone()
    expected[:, :, positions] = want_k
    assert torch.equal(cache, expected), "stored rows differ from the pair's key signatures, or other rows changed"


@pytest.mark.parametrize("layout", ["contiguous", "padded", "slot-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_into_matches_the_pair(device, dtype, shape, layout):
    batch, hq, lq, hk, hx, nk, dq, dk, hidden, bits = shape
    g = generator_for("pair-into", device, dtype, shape, layout)
    query = strided(batch, hq, lq, dq, g, dtype, device)
    key = strided(batch, hx, nk, dk, g, dtype, device)
    qw, qb = make_mlp(hq, [dq, *hidden, bits], g, dtype, device)
    kw, kb = make_mlp(hk, [dk, *hidden, bits], g, dtype, device)
    check_into(query, qw, qb, key, kw, kb, layout, g)


@pytest.mark.parametrize("encoder", ["fma", "mma", "cluster2", "cluster4"])
@pytest.mark.parametrize("batch", [1, 4, 6, 16])
def test_into_on_each_cuda_kernel(monkeypatch, encoder, batch):
    """A decode step of the paper's MLP (bf16 weights) through the float32, the tensor-core and the
    cluster kernels."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA kernels")
    monkeypatch.setenv("HASHATTENTION_ENCODER", encoder)
    g = generator_for("pair-into-kernel", encoder, batch)
    query = strided(batch, 8, 1, 128, g, torch.bfloat16, "cuda")
    key = strided(batch, 2, 1, 128, g, torch.bfloat16, "cuda")
    qw, qb = make_mlp(8, [128, 128, 128, 32], g, torch.bfloat16, "cuda")
    kw, kb = make_mlp(8, [128, 128, 128, 32], g, torch.bfloat16, "cuda")
    for layout in ("contiguous", "padded", "slot-major"):
        check_into(query, qw, qb, key, kw, kb, layout, g)


def test_cuda_skips_slots_out_of_range():
    """On CUDA the positions are device values (no host sync to check them): a slot outside the
    cache is not written, the others are."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA kernels")
    g = generator_for("pair-into-range")
    query = strided(2, 4, 1, 64, g, torch.float32, "cuda")
    key = strided(2, 2, 3, 64, g, torch.float32, "cuda")
    qw, qb = make_mlp(4, [64, 32, 32], g, torch.float32, "cuda")
    kw, kb = make_mlp(4, [64, 32, 32], g, torch.float32, "cuda")
    for rows in (3, 70):  # fused kernel; cuBLAS + row store
        key = strided(2, 2, rows, 64, g, torch.float32, "cuda")
        cache = random_signatures((2, 4, rows + 2, 1), g, "cuda")
        before = cache.clone()
        positions = torch.arange(rows, device="cuda")
        positions[1] = rows + 2  # past the end
        positions[2] = -1
        ha.encode_signatures_pair_into(query, qw, qb, key, kw, kb, cache, positions)
        _, want_k = ha.encode_signatures_pair(query, qw, qb, key, kw, kb)
        expected = before.clone()
        keep = torch.tensor([n not in (1, 2) for n in range(rows)], device="cuda")
        expected[:, :, positions[keep]] = want_k[:, :, keep]
        assert torch.equal(cache, expected)


def test_graph_replay_stores_at_new_positions():
    """Captured in a CUDA graph, a replay with new positions and inputs stores at the new slots."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA kernels")
    g = generator_for("pair-into-graph")
    query = strided(2, 8, 1, 128, g, torch.bfloat16, "cuda").contiguous()
    key = strided(2, 2, 1, 128, g, torch.bfloat16, "cuda").contiguous()
    qw, qb = make_mlp(8, [128, 128, 32], g, torch.bfloat16, "cuda")
    kw, kb = make_mlp(8, [128, 128, 32], g, torch.bfloat16, "cuda")
    cache = torch.zeros(2, 8, 16, 1, dtype=torch.int32, device="cuda")
    positions = torch.tensor([3], device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ha.encode_signatures_pair_into(query, qw, qb, key, kw, kb, cache, positions)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ha.encode_signatures_pair_into(query, qw, qb, key, kw, kb, cache, positions)
    for slot in (5, 11):
        cache.zero_()
        positions.fill_(slot)
        query.copy_(torch.randn(query.shape, generator=g).to(query))
        key.copy_(torch.randn(key.shape, generator=g).to(key))
        graph.replay()
        want_q, want_k = ha.encode_signatures_pair(query, qw, qb, key, kw, kb)
        expected = torch.zeros_like(cache)
        expected[:, :, slot] = want_k[:, :, 0]
        assert torch.equal(out, want_q) and torch.equal(cache, expected)


def bad_args(device="cpu"):
    g = generator_for("pair-into-bad")
    query = strided(2, 4, 1, 64, g, torch.float32, device)
    key = strided(2, 2, 3, 64, g, torch.float32, device)
    qw, qb = make_mlp(4, [64, 32], g, torch.float32, device)
    kw, kb = make_mlp(4, [64, 32], g, torch.float32, device)
    return dict(query=query, query_weights=qw, query_biases=qb, key=key, key_weights=kw, key_biases=kb,
                key_signatures=torch.zeros(2, 4, 9, 1, dtype=torch.int32, device=device),
                positions=torch.tensor([0, 4, 8], device=device))


@pytest.mark.parametrize("change, error, message", [
    (dict(key_signatures=torch.zeros(2, 4, 9, 1, dtype=torch.int64)), TypeError, "key_signatures must be Int"),
    (dict(key_signatures=torch.zeros(2, 4, 9, dtype=torch.int32)), ValueError, "key_signatures must have 4 dimensions"),
    (dict(key_signatures=torch.zeros(2, 2, 9, 1, dtype=torch.int32)), ValueError, r"key_signatures must have shape \(2, 4, slots >= 1, 1\)"),
    (dict(key_signatures=torch.zeros(2, 4, 9, 2, dtype=torch.int32)), ValueError, "key_signatures must have shape"),
    (dict(key_signatures=torch.zeros(1, 4, 9, 1, dtype=torch.int32)), ValueError, "key_signatures must have shape"),
    (dict(positions=torch.tensor([0, 4, 8], dtype=torch.int32)), TypeError, "positions must be Long"),
    (dict(positions=torch.tensor([0, 4])), ValueError, r"positions must have shape \(3,\)"),
    (dict(positions=torch.tensor([0, 4, 9])), ValueError, r"positions must lie in \[0, 9\)"),
    (dict(positions=torch.tensor([-1, 4, 8])), ValueError, r"positions must lie in \[0, 9\)"),
    (dict(positions=torch.tensor([4, 4, 8])), ValueError, "positions must be distinct, got 4 twice"),
])
def test_bad_input_is_named(change, error, message):
    args = bad_args()
    args.update(change)
    with pytest.raises(error, match=message):
        ha.encode_signatures_pair_into(**args)


def test_bad_device_is_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    args = bad_args("cuda")
    args["key_signatures"] = args["key_signatures"].cpu()
    with pytest.raises(ValueError, match="key_signatures is on cpu but key is on cuda"):
        ha.encode_signatures_pair_into(**args)
    args = bad_args("cuda")
    args["positions"] = args["positions"].cpu()
    with pytest.raises(ValueError, match="positions is on cpu but key is on cuda"):
        ha.encode_signatures_pair_into(**args)
