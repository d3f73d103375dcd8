"""torch.library.opcheck on every op: schema, fake kernel, autograd registration, AOT dispatch."""

import pytest
import torch

import hashattention  # noqa: F401  (registers the ops)
from op_helpers import generator_for, random_signatures

OPS = torch.ops.hashattention


def sample_calls(device):
    g = generator_for("opcheck", device)
    q_sig = random_signatures((2, 4, 3, 1), g, device)
    k_sig = random_signatures((2, 2, 50, 1), g, device)
    x = torch.randn(2, 4, 5, 64, generator=g).to(device)
    weights = [torch.randn(4, 64, 32, generator=g).to(device), torch.randn(4, 32, 64, generator=g).to(device)]
    biases = [torch.randn(4, 32, generator=g).to(device), torch.randn(4, 64, generator=g).to(device)]
    lengths = torch.tensor([50, 31], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 3], dtype=torch.int32, device=device)
    budgets = torch.tensor([5, 100], dtype=torch.int32, device=device)
    scores = torch.randn(2, 2, 3, 50, generator=g).to(device)
    q = torch.randn(2, 4, 3, 64, generator=g).to(device)
    k = torch.randn(2, 2, 50, 64, generator=g).to(device)
    v = torch.randn(2, 2, 50, 64, generator=g).to(device)
    indices = torch.randint(0, 50, (2, 2, 3, 10), generator=g).to(torch.int32).to(device)
    counts = torch.randint(0, 11, (2, 2, 3), generator=g).to(torch.int32).to(device)
    k_pages = torch.randn(20, 4, 2, 64, generator=g).to(device)
    block_table = torch.randperm(20, generator=g)[:14].reshape(2, 7).to(torch.int32).to(device)
    return [
        ("encode_signatures", (x, weights, biases, "silu")),
        # A decode step: 4 query heads and key MLPs over 2 KV heads, different N; then Hx = Hk.
        ("encode_signatures_pair", (x[:, :, :1], weights, biases, x[:, :2, :3], weights, biases, "silu")),
        ("encode_signatures_pair", (x, weights, biases, x[:1, :, 1:3], weights, biases, "gelu")),
        # The same decode step with the key's three signature rows stored into a 9-slot cache.
        ("encode_signatures_pair_into", (x[:, :, :1], weights, biases, x[:, :2, :3], weights, biases,
                                         random_signatures((2, 4, 9, 2), g, device),
                                         torch.tensor([7, 0, 4], device=device), "silu")),
        # That step's selection from the query rows: 4 selection heads (per query head), then 2 (groups).
        ("encode_pair_and_select", (x[:, :, :1], weights, biases, x[:, :2, :3], weights, biases,
                                    random_signatures((2, 4, 9, 2), g, device), torch.tensor([7, 0, 4], device=device),
                                    "silu", 4, 2, 2, 3, torch.tensor([9, 6], dtype=torch.int32, device=device),
                                    None, None)),
        ("encode_pair_and_select", (x[:, :, :1], weights, biases, x[:, :2, :0], weights, biases,
                                    random_signatures((2, 4, 9, 2), g, device), torch.tensor([8], device=device)[:0],
                                    "relu", 2, 0, 1, 4, None, None, None)),
        ("pack_signs", (torch.randn(3, 5, 64, generator=g).to(device),)),
        ("hamming_scores", (q_sig, k_sig, 2)),
        ("hamming_topk", (q_sig, k_sig, lengths, starts, budgets, 4, 4, 4, 8)),
        ("hamming_topk", (q_sig, k_sig, None, None, None, 2, 0, 2, 100)),
        ("topk_from_scores", (scores, lengths, starts, budgets, 2, 3, 6)),
        ("sparse_attention", (q, k, v, indices, counts, None, 0.125)),
        ("sparse_attention", (q, k_pages, k_pages, indices % 28, None, block_table, 0.125)),
        ("first_visible_key", (torch.rand(3, 50, generator=g).to(device) > 0.7,)),
        ("selection_bounds", (lengths, torch.rand(2, 50, generator=g).to(device) > 0.7, 8.0, None, 6, 0)),
        ("selection_bounds", (lengths.long(), None, None, 20, 6, 40)),
    ]


@pytest.mark.parametrize("call", range(len(sample_calls("cpu"))))
def test_opcheck(device, call):
    name, args = sample_calls(device)[call]
    torch.library.opcheck(getattr(OPS, name).default, args)


@pytest.mark.parametrize("call", range(len(sample_calls("cpu"))))
def test_all_meta_inputs_give_the_shapes_of_the_cpu_outputs(call):
    """Meta tensors alone are one device: the fake kernel runs, and the device check it makes (a mix
    with meta is rejected) lets them through."""
    name, cpu_args = sample_calls("cpu")[call]
    _, meta_args = sample_calls("meta")[call]
    op = getattr(OPS, name).default
    expected, got = op(*cpu_args), op(*meta_args)
    expected, got = ((t,) if isinstance(t, torch.Tensor) else tuple(t) for t in (expected, got))
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected]
    assert all(t.device.type == "meta" for t in got)
