"""Bad input gets a clear error naming the argument and what was expected, never a crash.

Shape/value problems raise ValueError, dtype problems TypeError. The checks are shared by
the CPU and CUDA kernels; checks that read tensor values (lengths <= N, index ranges) are
CPU-only, since on the GPU they would force a host sync. Two checks are Python's: device mixes
that include meta (which dispatch to the fake kernels) and integers beyond int64 (which the op
schema cannot carry).
"""

import pytest
import torch

import hashattention as ha
from op_helpers import DEVICES


def sig(*shape, device="cpu"):
    return torch.zeros(shape, dtype=torch.int32, device=device)


def i32(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def mlp(heads=4, sizes=(64, 32, 32), device="cpu"):
    weights = [torch.randn(heads, a, b, device=device) for a, b in zip(sizes[:-1], sizes[1:])]
    biases = [torch.randn(heads, b, device=device) for b in sizes[1:]]
    return weights, biases


def topk(q, k, **overrides):
    kwargs = dict(selection_heads=q.shape[1], sink_tokens=2, local_tokens=2, budget_tokens=4)
    kwargs.update(overrides)
    return ha.hamming_topk(q, k, **kwargs)


def encode_and_select(**overrides):
    weights, biases = mlp()
    key_signatures = sig(1, 4, 9, 1)
    kwargs = dict(selection_heads=4, sink_tokens=1, local_tokens=1, budget_tokens=2)
    kwargs.update(overrides)
    return ha.encode_pair_and_select(torch.randn(1, 4, 1, 64), weights, biases, torch.randn(1, 4, 1, 64), weights,
                                     biases, key_signatures, torch.tensor([8]), **kwargs)


def attention(q=None, k=None, v=None, indices=None, counts=None, **kwargs):
    q = torch.randn(1, 4, 1, 64) if q is None else q
    k = torch.randn(1, 2, 10, 64) if k is None else k
    v = k.clone() if v is None else v
    indices = i32(0, 1, 2).reshape(1, 1, 1, 3) if indices is None else indices
    kwargs.setdefault("scale", 0.125)
    return ha.sparse_attention(q, k, v, indices, counts, **kwargs)


# (description, callable, expected exception, regex the message must match)
CASES = [
    # dtypes
    ("float signatures", lambda: topk(torch.zeros(1, 4, 1, 1), sig(1, 4, 8, 1)), TypeError,
     "query_signatures must be Int"),
    ("int64 key signatures", lambda: ha.hamming_scores(sig(1, 4, 1, 1), torch.zeros(1, 4, 8, 1, dtype=torch.int64), 4),
     TypeError, "key_signatures must be Int"),
    ("int64 lengths", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), lengths=torch.tensor([8])), TypeError,
     "lengths must be Int"),
    ("integer queries", lambda: attention(q=torch.ones(1, 4, 1, 64, dtype=torch.int32)), TypeError,
     "query must be float32, float16 or bfloat16"),
    ("integer encode input", lambda: ha.encode_signatures(torch.ones(1, 4, 2, 64, dtype=torch.long), *mlp()),
     TypeError, "x must be float32"),
    ("key dtype differs from query", lambda: attention(k=torch.randn(1, 2, 10, 64, dtype=torch.float16)), TypeError,
     "key_cache must have the query's dtype"),
    ("int64 indices", lambda: attention(indices=torch.zeros(1, 1, 1, 3, dtype=torch.int64)), TypeError,
     "indices must be Int"),
    ("complex scores", lambda: ha.topk_from_scores(torch.zeros(1, 1, 1, 4, dtype=torch.complex64), sink_tokens=1,
                                                   local_tokens=1, budget_tokens=1), TypeError, "scores must be a real"),
    ("pack integer values", lambda: ha.pack_signs(torch.ones(2, 32, dtype=torch.int32)), TypeError,
     "values must be a floating-point"),
    # shapes
    ("mismatched words", lambda: ha.hamming_scores(sig(1, 4, 1, 1), sig(1, 4, 8, 2), 4), ValueError,
     r"key_signatures words \(2\) must equal query_signatures words \(1\)"),
    ("mismatched batch", lambda: ha.hamming_scores(sig(2, 4, 1, 1), sig(1, 4, 8, 1), 4), ValueError,
     r"key_signatures batch \(1\) must equal query_signatures batch \(2\)"),
    ("key heads not dividing", lambda: ha.hamming_scores(sig(1, 4, 1, 1), sig(1, 3, 8, 1), 4), ValueError,
     r"key_signatures heads \(3\) must divide query_signatures heads \(4\)"),
    ("selection heads not dividing", lambda: ha.hamming_scores(sig(1, 4, 1, 1), sig(1, 4, 8, 1), 3), ValueError,
     r"selection_heads \(3\) must divide"),
    ("too many words", lambda: ha.hamming_scores(sig(1, 1, 1, 33), sig(1, 1, 8, 33), 1), ValueError,
     "1 to 32 int32 words"),
    ("3-d signatures", lambda: ha.hamming_scores(sig(4, 1, 1), sig(1, 4, 8, 1), 4), ValueError,
     "query_signatures must have 4 dimensions"),
    ("mismatched head_dim", lambda: attention(k=torch.randn(1, 2, 10, 128)), ValueError,
     r"key_cache head_dim \(128\) must equal query head_dim \(64\)"),
    ("unsupported head_dim", lambda: attention(q=torch.randn(1, 4, 1, 80), k=torch.randn(1, 2, 10, 80)), ValueError,
     "head_dim must be 64, 128 or 256, got 80"),
    ("kv heads not dividing", lambda: attention(k=torch.randn(1, 3, 10, 64)), ValueError,
     r"KV heads \(3\) must divide query heads \(4\)"),
    ("value shape differs", lambda: attention(v=torch.randn(1, 2, 11, 64)), ValueError,
     "value_cache shape .* must equal key_cache shape"),
    ("indices batch differs", lambda: attention(indices=sig(2, 1, 1, 3)), ValueError, "indices must have shape"),
    ("counts shape", lambda: attention(counts=sig(1, 1, 2)), ValueError, "counts must have shape"),
    ("int64 attention workspace", lambda: attention(workspace=torch.zeros(4, dtype=torch.int64)), TypeError,
     "workspace must be Int"),
    ("attention workspace too small", lambda: attention(workspace=sig(3)), ValueError,
     r"workspace must have at least batch \* query_heads \* rows = 4 elements, got 3"),
    ("non-contiguous attention workspace", lambda: attention(workspace=sig(8)[::2]), ValueError,
     "workspace must be contiguous"),
    ("lengths wrong shape", lambda: topk(sig(2, 4, 1, 1), sig(2, 4, 8, 1), lengths=i32(8)), ValueError,
     r"lengths must have shape \(batch,\) = \(2,\)"),
    ("block table wrong shape", lambda: attention(k=torch.randn(5, 4, 2, 64), block_table=sig(2, 3)), ValueError,
     "block_table must have shape"),
    ("encode width mismatch", lambda: ha.encode_signatures(torch.randn(1, 4, 2, 64), *mlp(sizes=(32, 32))),
     ValueError, r"weights\[0\] must have in_features = 64"),
    ("encode heads mismatch", lambda: ha.encode_signatures(torch.randn(1, 3, 2, 64), *mlp()), ValueError,
     r"weights\[0\] must have one matrix per head \(3 heads in x\)"),
    ("encode bits not a multiple of 32", lambda: ha.encode_signatures(torch.randn(1, 4, 2, 64), *mlp(sizes=(64, 48))),
     ValueError, "multiple of 32, got 48"),
    ("encode bias shape", lambda: ha.encode_signatures(torch.randn(1, 4, 2, 64), [torch.randn(4, 64, 32)],
                                                       [torch.randn(32)]), ValueError, r"biases\[0\] must have shape"),
    ("encode unknown activation", lambda: ha.encode_signatures(torch.randn(1, 4, 2, 64), *mlp(), "swish"), ValueError,
     "activation must be one of"),
    ("encode no layers", lambda: ha.encode_signatures(torch.randn(1, 4, 2, 64), [], []), ValueError,
     "at least one layer"),
    ("pack bits not multiple of 32", lambda: ha.pack_signs(torch.randn(3, 40)), ValueError, "multiple of 32, got 40"),
    ("non-contiguous signatures", lambda: ha.hamming_scores(sig(1, 4, 1, 4)[..., ::2], sig(1, 4, 8, 2), 4),
     ValueError, "query_signatures must be contiguous in its last dimension"),
    ("non-contiguous key cache", lambda: attention(k=torch.randn(1, 2, 10, 128)[..., ::2]), ValueError,
     "key_cache must be contiguous in its last dimension"),
    # windows and budgets
    ("negative sink", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), sink_tokens=-1), ValueError,
     r"sink_tokens must be in \[0, 2\^31 - 1\], got -1"),
    ("negative local", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), local_tokens=-3), ValueError,
     "local_tokens must be in"),
    ("negative budget", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), budget_tokens=-2), ValueError,
     "budget_tokens must be in"),
    ("oversized budget", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), budget_tokens=2**31), ValueError,
     "budget_tokens must be in"),
    ("oversized width", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), sink_tokens=2**30, local_tokens=2**30,
                                     budget_tokens=2**30), ValueError, "must fit in int32"),
    ("nothing to select", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), sink_tokens=0, local_tokens=0,
                                       budget_tokens=0), ValueError, "must be >= 1"),
    # integers beyond int32, and beyond the schema's int64 (which torch would reject without a name)
    ("budget 2^40", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), budget_tokens=2**40), ValueError,
     r"budget_tokens must be in \[0, 2\^31 - 1\], got 1099511627776"),
    ("budget 2^70", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), budget_tokens=2**70), ValueError,
     r"budget_tokens must be in \[0, 2\^31 - 1\], got 1180591620717411303424"),
    ("sink 2^64", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), sink_tokens=2**64), ValueError,
     r"sink_tokens must be in \[0, 2\^31 - 1\], got 18446744073709551616"),
    ("local -2^70", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), local_tokens=-(2**70)), ValueError,
     r"local_tokens must be in \[0, 2\^31 - 1\], got -1180591620717411303424"),
    ("selection heads 2^70 (top-k)", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), selection_heads=2**70),
     ValueError, "selection_heads must be a divisor of the query heads, got 1180591620717411303424"),
    ("selection heads 2^70 (scores)", lambda: ha.hamming_scores(sig(1, 4, 1, 1), sig(1, 4, 8, 1), 2**70),
     ValueError, "selection_heads must be a divisor of the query heads, got 1180591620717411303424"),
    ("scores budget 2^70", lambda: ha.topk_from_scores(torch.zeros(1, 1, 1, 4), sink_tokens=1, local_tokens=1,
                                                       budget_tokens=2**70), ValueError, "budget_tokens must be in"),
    ("encode-and-select budget 2^70", lambda: encode_and_select(budget_tokens=2**70), ValueError,
     "budget_tokens must be in"),
    ("more keys than int32 positions (top-k)", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 1, 1).expand(1, 4, 2**31, 1)),
     ValueError, "key_signatures has 2147483648 keys; the selected positions are int32"),
    ("more keys than int32 positions (scores)",
     lambda: ha.topk_from_scores(torch.zeros(1, 1, 1, 1).expand(1, 1, 1, 2**31), sink_tokens=1, local_tokens=1,
                                 budget_tokens=1), ValueError, "scores has 2147483648 keys; the selected positions"),
    # values (CPU checks)
    ("lengths > N", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), lengths=i32(9)), ValueError,
     r"lengths\[0\] = 9 must be in \[0, N\] where N = 8"),
    ("negative length", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), lengths=i32(-1)), ValueError,
     r"lengths\[0\] = -1"),
    ("start offset > length", lambda: topk(sig(1, 4, 1, 1), sig(1, 4, 8, 1), lengths=i32(5), start_positions=i32(6)),
     ValueError, r"start_positions\[0\] = 6 must be in \[0, lengths\[0\]\] = \[0, 5\]"),
    ("index out of range", lambda: attention(indices=i32(0, 10, 2).reshape(1, 1, 1, 3)), ValueError,
     r"indices must be in \[0, 10\)"),
    ("negative index within count", lambda: attention(indices=i32(0, -1, 2).reshape(1, 1, 1, 3),
                                                      counts=i32(3).reshape(1, 1, 1)), ValueError, "got -1"),
    ("count above width", lambda: attention(counts=i32(4).reshape(1, 1, 1)), ValueError,
     r"counts must be in \[0, width=3\]"),
    ("block table entry out of range", lambda: attention(k=torch.randn(5, 4, 2, 64), block_table=i32(0, 9).reshape(1, 2),
                                                         indices=i32(0, 5).reshape(1, 1, 1, 2)), ValueError,
     r"block_table\[0, 1\] = 9 must be in \[0, num_pages=5\)"),
    # empty batch
    ("empty batch (signatures)", lambda: topk(sig(0, 4, 1, 1), sig(0, 4, 8, 1)), ValueError, "empty batch"),
    ("empty batch (attention)", lambda: attention(q=torch.randn(0, 4, 1, 64), k=torch.randn(0, 2, 10, 64),
                                                  indices=sig(0, 1, 1, 3)), ValueError, "empty batch"),
    ("empty batch (scores)", lambda: ha.topk_from_scores(torch.zeros(0, 1, 1, 4), sink_tokens=1, local_tokens=1,
                                                         budget_tokens=1), ValueError, "empty batch"),
]


@pytest.mark.parametrize("description,call,error,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_a_clear_message(description, call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_device_mismatch_is_rejected():
    with pytest.raises(ValueError, match="key_signatures is on cpu but query_signatures is on cuda"):
        ha.hamming_scores(sig(1, 4, 1, 1, device="cuda"), sig(1, 4, 8, 1), 4)
    with pytest.raises(ValueError, match="lengths is on cpu but query_signatures is on cuda"):
        topk(sig(1, 4, 1, 1, device="cuda"), sig(1, 4, 8, 1, device="cuda"), lengths=i32(8))
    with pytest.raises(ValueError, match="value_cache is on cpu but query is on cuda"):
        attention(q=torch.randn(1, 4, 1, 64, device="cuda"), k=torch.randn(1, 2, 10, 64, device="cuda"),
                  v=torch.randn(1, 2, 10, 64), indices=i32(0, 1, device="cuda").reshape(1, 1, 1, 2))
    with pytest.raises(ValueError, match="workspace is on cpu but query is on cuda"):
        cuda = dict(q=torch.randn(1, 4, 1, 64, device="cuda"), k=torch.randn(1, 2, 10, 64, device="cuda"))
        attention(**cuda, indices=i32(0, 1, device="cuda").reshape(1, 1, 1, 2), workspace=sig(4))


def meta_mix_cases(device):
    """(description, call, message): one argument on the meta device, the others on `device`.

    A mix that includes a meta tensor dispatches to the op's fake kernel rather than to the device
    kernel whose argument check rejects mixed devices."""
    on, meta = dict(device=device), dict(device="meta")
    q_sig, k_sig = sig(1, 4, 1, 1, **on), sig(1, 4, 8, 1, **on)
    x, weights, biases = torch.randn(1, 4, 1, 64, **on), *mlp(device=device)
    meta_weights = [weights[0], weights[1].to("meta")]
    q, k = torch.randn(1, 4, 1, 64, **on), torch.randn(1, 2, 10, 64, **on)
    indices = i32(0, 1, 2, **on).reshape(1, 1, 1, 3)
    pages, table = torch.randn(5, 4, 2, 64, **on), i32(0, 1, **on).reshape(1, 2)
    slots, positions = sig(1, 4, 9, 1, **on), torch.tensor([8], **on)

    def pair_into(**changed):
        args = dict(key_signatures=slots, positions=positions)
        args.update(changed)
        return ha.encode_signatures_pair_into(x, weights, biases, x, weights, biases, **args)

    def select(**changed):
        args = dict(key_signatures=slots, positions=positions, selection_heads=4, sink_tokens=1, local_tokens=1,
                    budget_tokens=2)
        args.update(changed)
        return ha.encode_pair_and_select(x, weights, biases, x, weights, biases, **args)

    def attend(**changed):
        args = dict(query=q, key_cache=k, value_cache=k, indices=indices, scale=0.125)
        args.update(changed)
        return ha.sparse_attention(**args)

    return [
        ("scores: key_signatures", lambda: ha.hamming_scores(q_sig, k_sig.to("meta"), 4),
         f"key_signatures is on meta but query_signatures is on {device}"),
        ("scores: query_signatures", lambda: ha.hamming_scores(q_sig.to("meta"), k_sig, 4),
         f"key_signatures is on {device}.* but query_signatures is on meta"),
        ("top-k: lengths", lambda: topk(q_sig, k_sig, lengths=i32(8, **meta)),
         f"lengths is on meta but query_signatures is on {device}"),
        ("top-k: budgets", lambda: topk(q_sig, k_sig, budgets=i32(2, **meta)),
         f"budgets is on meta but query_signatures is on {device}"),
        ("scores top-k: start_positions", lambda: ha.topk_from_scores(
            torch.zeros(1, 1, 1, 4, **on), start_positions=i32(0, **meta), sink_tokens=1, local_tokens=1,
            budget_tokens=1), f"start_positions is on meta but scores is on {device}"),
        ("encode: weights[1]", lambda: ha.encode_signatures(x, meta_weights, biases),
         f"weights\\[1\\] is on meta but x is on {device}"),
        ("pair: key", lambda: ha.encode_signatures_pair(x, weights, biases, x.to("meta"), weights, biases),
         f"key is on meta but query is on {device}"),
        ("pair: key_weights[1]", lambda: ha.encode_signatures_pair(x, weights, biases, x, meta_weights, biases),
         f"key_weights\\[1\\] is on meta but key is on {device}"),
        ("pair into: positions", lambda: pair_into(positions=positions.to("meta")),
         f"positions is on meta but key is on {device}"),
        ("pair into: key_signatures", lambda: pair_into(key_signatures=slots.to("meta")),
         f"key_signatures is on meta but key is on {device}"),
        ("encode and select: lengths", lambda: select(lengths=i32(9, **meta)),
         f"lengths is on meta but query is on {device}"),
        ("attention: key_cache", lambda: attend(key_cache=k.to("meta")),
         f"key_cache is on meta but query is on {device}"),
        ("attention: query", lambda: attend(query=q.to("meta")), f"key_cache is on {device}.* but query is on meta"),
        ("attention: counts", lambda: attend(counts=i32(3, **meta).reshape(1, 1, 1)),
         f"counts is on meta but query is on {device}"),
        ("attention: block_table", lambda: attend(key_cache=pages, value_cache=pages, block_table=table.to("meta")),
         f"block_table is on meta but query is on {device}"),
        ("attention: workspace", lambda: attend(workspace=sig(4, **meta)),
         f"workspace is on meta but query is on {device}"),
    ]


@pytest.mark.parametrize("case", range(len(meta_mix_cases("cpu"))), ids=[c[0] for c in meta_mix_cases("cpu")])
def test_meta_tensor_mixed_with_device_tensors_is_rejected(device, case):
    """Never the fake kernel's uninitialised outputs: the message names the argument and both devices."""
    _, call, message = meta_mix_cases(device)[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_missing_extension_error_says_how_to_build(monkeypatch):
    import importlib

    from hashattention import _library

    def fail(name):
        raise ImportError("libfoo.so: cannot open shared object file")

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError, match="pip install --no-build-isolation -e ."):
        _library.load_extension()
