"""The validation metric: per-row budgets and recall through the ops, against a brute-force selection."""

import math

import pytest
import torch

from hashattention.adapters import AdapterConfig, LayerAdapter
from train.config import TrainConfig
from train.validate import layer_recall, lsh_projections, recall, row_budgets, selection_mask, true_top_k


def _popcount_similarity(a: int, b: int, bits: int) -> int:
    return bits - bin((a ^ b) & 0xFFFFFFFF).count("1")


def _brute_force_selection(q_sig, k_sig, p, sink, local, heavy, bits):
    """Sink + local windows + the `heavy` best remaining keys by Hamming similarity (ties: later first)."""
    chosen = set(range(min(sink, p + 1))) | set(range(max(0, p - local + 1), p + 1))
    rest = [j for j in range(p + 1) if j not in chosen]
    rest.sort(key=lambda j: (-_popcount_similarity(q_sig, int(k_sig[j]), bits), -j))
    return chosen | set(rest[:heavy])


def test_row_budgets_count_windows_in_the_total():
    positions = torch.tensor([63, 127, 200, 1023])
    got = row_budgets(positions, 16, 2, 3)
    assert got.tolist() == [max(0, (p + 1) // 16 - 5) for p in positions.tolist()]
    assert got.dtype == torch.int32


def test_selection_mask_ignores_padding():
    indices = torch.tensor([[[[0, 3, -1]], [[1, -1, -1]]]], dtype=torch.int32)  # (Q=1, Hs=2, 1, K=3)
    mask = selection_mask(indices, 5)
    assert mask.shape == (1, 2, 5)
    assert mask[0, 0].tolist() == [True, False, False, True, False]
    assert mask[0, 1].tolist() == [False, True, False, False, False]


def test_recall_counts_hits_over_truth():
    scores = torch.tensor([[[0.0, 5.0, 4.0, 3.0, 2.0, 9.0]], [[7.0, 0.0, 0.0, 0.0, 0.0, 6.0]]])  # (H=2, Q=1, N=6)
    eligible = torch.tensor([[True, True, True, True, True, False]])
    indices, valid = true_top_k(scores, eligible, 4)
    assert sorted(indices[0, 0].tolist()) == [1, 2, 3, 4] and valid.all()
    selected = torch.zeros(1, 2, 6, dtype=torch.bool)  # (Q, H, N)
    selected[0, 0, [1, 4, 5]] = True
    selected[0, 1, [0, 5]] = True
    assert recall(indices, valid, selected).tolist() == [0.5, 0.25]
    few = torch.tensor([[False, True, True, False, False, False]])  # only 2 eligible keys: 2 valid entries
    indices, valid = true_top_k(scores, few, 4)
    assert valid.sum(-1).tolist() == [[2, 2]]
    assert recall(indices, valid, selected).tolist() == [0.5, 0.0]


@pytest.mark.parametrize("key_heads", ["query", "kv"])
def test_layer_recall_matches_brute_force(key_heads):
    torch.manual_seed(0)
    heads, kv_heads, dim, num_keys = 4, 2, 16, 160
    config = TrainConfig(sequence_tokens=num_keys, queries_per_sequence=6, top_k=5, sink_tokens=3, local_tokens=4,
                         key_heads=key_heads, sparsities=(4, 8), work_dir="unused")
    adapter = LayerAdapter(AdapterConfig(num_layers=1, num_query_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                         key_heads=key_heads, hidden_features=(8,)))
    positions = torch.tensor([60, 77, 100, 120, 141, 159])
    sample = {"query_positions": positions, "queries": torch.randn(heads, 6, dim),
              "keys": torch.randn(kv_heads, num_keys, dim), "value_norms": torch.ones(kv_heads, num_keys)}
    got = layer_recall(config, adapter, [sample], layer=0)

    group = heads // kv_heads
    q_sigs = adapter.query_signatures(sample["queries"][None])[0, :, :, 0]
    k_sigs = adapter.key_signatures(sample["keys"][None])[0, :, :, 0]
    projections = lsh_projections(config, 0, kv_heads if key_heads == "kv" else heads, dim)

    def lsh(x, h):  # bit j = (x · R[:, j] > 0), packed little-endian into one int32 word
        bits = (x @ projections[h] > 0).long()
        return int((bits << torch.arange(32)).sum()) & 0xFFFFFFFF

    for name in ("learned", "lsh", "oracle"):
        for sparsity in (4, 8):
            hits = total = 0
            for h in range(heads):
                key_head = h // group
                sig_head = key_head if key_heads == "kv" else h
                for r, p in enumerate(positions.tolist()):
                    dots = sample["keys"][key_head] @ sample["queries"][h, r] / math.sqrt(dim)
                    eligible = [j for j in range(3, p - 4 + 1)]
                    truth = set(sorted(eligible, key=lambda j: -float(dots[j]))[:5])
                    heavy = max(0, (p + 1) // sparsity - 7)
                    if name == "oracle":
                        if key_heads == "kv":
                            members = range(key_head * group, (key_head + 1) * group)
                            mass = sum(torch.softmax(sample["keys"][key_head, : p + 1] @ sample["queries"][m, r]
                                                     / math.sqrt(dim), -1) for m in members)
                        else:
                            mass = dots[: p + 1]
                        chosen = set(range(3)) | set(range(p - 3, p + 1))
                        rest = sorted((j for j in range(p + 1) if j not in chosen), key=lambda j: (-float(mass[j]), -j))
                        selected = chosen | set(rest[:heavy])
                    else:
                        if key_heads == "kv":  # group-shared: the token's score sums the group's similarities
                            members = list(range(key_head * group, (key_head + 1) * group))
                        else:
                            members = [h]
                        chosen = set(range(3)) | set(range(p - 3, p + 1))
                        def score(j):
                            total_score = 0
                            for m in members:
                                if name == "learned":
                                    qs, ks = int(q_sigs[m, r]) & 0xFFFFFFFF, int(k_sigs[sig_head, j]) & 0xFFFFFFFF
                                else:
                                    qs = lsh(sample["queries"][m, r], m // group if key_heads == "kv" else m)
                                    ks = lsh(sample["keys"][key_head, j], sig_head)
                                total_score += _popcount_similarity(qs, ks, 32)
                            return total_score
                        rest = sorted((j for j in range(p + 1) if j not in chosen), key=lambda j: (-score(j), -j))
                        selected = chosen | set(rest[:heavy])
                    hits += len(truth & selected)
                    total += len(truth)
            # layer_recall averages per head then over heads; with equal truth sizes that is hits / total
            assert got[name][f"{sparsity}x"] == pytest.approx(hits / total, abs=1e-12), (name, sparsity)
    if key_heads == "query":  # every row has >= top_k heavy tokens at n/4; a shared selection can miss a head's own
        assert got["oracle"]["4x"] == pytest.approx(1.0)
