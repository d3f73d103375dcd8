"""Training targets and loss: masks, top-k labels and the weighted BCE against hand computations."""

import math

import pytest
import torch

from hashattention.adapters import AdapterConfig, LayerAdapter
from train.config import TrainConfig
from train.fit import add_labels, sequence_loss, signature_logits, weighted_bce_loss
from train.labels import causal_keys, eligible_keys, target_scores, top_k_labels


def test_weighted_bce_matches_hand_computation():
    logits = torch.tensor([[[0.5, -1.0, 2.0, 0.0], [1.5, 0.25, -0.5, 3.0]]], dtype=torch.float64)
    labels = torch.tensor([[[True, False, False, True], [False, True, False, False]]])
    included = torch.tensor([[True, True, False, True], [True, True, True, False]])
    weight = torch.tensor([3.0, 20.0], dtype=torch.float64)

    def log_sigmoid(z):
        return math.log(1.0 / (1.0 + math.exp(-z)))

    total, count = 0.0, 0
    for q in range(2):
        for j in range(4):
            if not included[q, j]:
                continue
            z, y = float(logits[0, q, j]), float(labels[0, q, j])
            total += -(float(weight[q]) * y * log_sigmoid(z) + (1 - y) * log_sigmoid(-z))
            count += 1
    got = weighted_bce_loss(logits, labels, included, weight)
    assert got.item() == pytest.approx(total / count, rel=1e-12)


def test_excluded_cells_get_no_gradient():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.rand(2, 3, 5) < 0.3
    included = torch.rand(3, 5) < 0.5
    included[0, 0] = True
    weighted_bce_loss(logits, labels, included, torch.full((3,), 7.0, dtype=torch.float64)).backward()
    assert torch.all(logits.grad[:, ~included] == 0)
    assert torch.all(logits.grad[:, included] != 0)


def test_signature_logits_are_tanh_products_minus_threshold():
    torch.manual_seed(0)
    config = AdapterConfig(num_layers=1, num_query_heads=4, num_kv_heads=2, head_dim=8, hidden_features=(6,))
    layer = LayerAdapter(config)
    queries, keys = torch.randn(4, 3, 8), torch.randn(2, 5, 8)
    got = signature_logits(layer, queries, keys, threshold=0.75)
    for h in range(4):
        fq = torch.tanh(layer.query(queries[None])[0, h])
        fk = torch.tanh(layer.key(keys[None].repeat_interleave(2, dim=1))[0, h])
        torch.testing.assert_close(got[h], fq @ fk.T - 0.75)


def test_eligible_keys_exclude_sink_local_and_future():
    positions = torch.tensor([0, 5, 9, 20])
    got = eligible_keys(positions, 24, sink_tokens=3, local_tokens=4)
    for r, p in enumerate(positions.tolist()):
        for j in range(24):
            expected = j >= 3 and j <= p and j <= p - 4  # not sink, not among the 4 latest, not future
            assert bool(got[r, j]) == expected, (p, j)
    assert torch.equal(causal_keys(positions, 24), torch.arange(24)[None] <= positions[:, None])


def test_top_k_labels_match_brute_force():
    torch.manual_seed(1)
    positions = torch.tensor([30, 41, 63])
    scores = torch.randn(3, 3, 64)
    eligible = eligible_keys(positions, 64, 4, 6)
    got = top_k_labels(scores, eligible, top_k=5)
    for h in range(3):
        for r in range(3):
            candidates = [j for j in range(64) if eligible[r, j]]
            best = sorted(candidates, key=lambda j: -float(scores[h, r, j]))[:5]
            assert set(torch.nonzero(got[h, r]).flatten().tolist()) == set(best)


def test_group_labels_are_shared_and_rank_summed_probabilities():
    torch.manual_seed(2)
    positions = torch.tensor([20, 31])
    scores = torch.randn(4, 2, 32)
    eligible = eligible_keys(positions, 32, 2, 3)
    causal = causal_keys(positions, 32)
    got = top_k_labels(scores, eligible, top_k=4, group_size=2, causal=causal)
    for g in range(2):
        assert torch.equal(got[2 * g], got[2 * g + 1])
        for r, p in enumerate(positions.tolist()):
            mass = sum(torch.softmax(scores[h, r, : p + 1], -1) for h in (2 * g, 2 * g + 1))
            candidates = [j for j in range(32) if eligible[r, j]]
            best = sorted(candidates, key=lambda j: -float(mass[j]))[:4]
            assert set(torch.nonzero(got[2 * g, r]).flatten().tolist()) == set(best)
    with pytest.raises(ValueError, match="causal"):
        top_k_labels(scores, eligible, 4, group_size=2)


def test_target_scores_with_value_norms():
    torch.manual_seed(3)
    queries, keys, norms = torch.randn(4, 2, 8), torch.randn(2, 6, 8), torch.rand(2, 6) + 0.5
    plain = target_scores(queries, keys)
    for h in range(4):
        torch.testing.assert_close(plain[h], queries[h] @ keys[h // 2].T / math.sqrt(8))
    weighted = target_scores(queries, keys, norms, "qk_log_value_norm")
    torch.testing.assert_close(weighted, plain + norms.log().repeat_interleave(2, 0)[:, None, :])
    with pytest.raises(ValueError, match="value_norms"):
        target_scores(queries, keys, None, "qk_log_value_norm")


def test_sequence_loss_uses_the_top_k_labels():
    """A loss computed by hand from brute-force labels equals the pipeline's."""
    torch.manual_seed(4)
    config = TrainConfig(sequence_tokens=64, queries_per_sequence=4, top_k=3, sink_tokens=2, local_tokens=2,
                         alpha=5.0, beta=0.5, threshold=0.25, work_dir="unused")
    layer = LayerAdapter(AdapterConfig(num_layers=1, num_query_heads=2, num_kv_heads=1, head_dim=8, hidden_features=(4,)))
    sample = {"query_positions": torch.tensor([40, 50, 60, 63]), "queries": torch.randn(2, 4, 8),
              "keys": torch.randn(1, 64, 8), "value_norms": torch.rand(1, 64)}
    got = sequence_loss(layer, config, sample)
    total, count = 0.0, 0
    logits = signature_logits(layer, sample["queries"], sample["keys"], 0.25)
    for h in range(2):
        for r, p in enumerate(sample["query_positions"].tolist()):
            candidates = list(range(2, p - 2 + 1))
            dots = {j: float(sample["queries"][h, r] @ sample["keys"][0, j]) for j in candidates}
            top = set(sorted(candidates, key=lambda j: -dots[j])[:3])
            for j in candidates:
                z = float(logits[h, r, j].detach())
                weight = 5.0 + 0.5 * (p + 1)
                total += weight * math.log1p(math.exp(-z)) if j in top else math.log1p(math.exp(z))
                count += 1
    assert got.item() == pytest.approx(total / count, rel=1e-5)
    assert add_labels(config, sample)["keys"].shape[1] == 64


def test_attention_weighted_positives_match_a_hand_computation():
    """positive_attention_mix: each positive's weight is scaled by (1 - m) + m*k*p, p = its softmax
    probability over the causal keys renormalised over the row's positives; negatives unchanged."""
    torch.manual_seed(5)
    mix = 0.75
    config = TrainConfig(sequence_tokens=64, queries_per_sequence=3, top_k=4, sink_tokens=2, local_tokens=2,
                         alpha=3.0, positive_attention_mix=mix, work_dir="unused")
    layer = LayerAdapter(AdapterConfig(num_layers=1, num_query_heads=2, num_kv_heads=1, head_dim=8, hidden_features=(4,)))
    sample = {"query_positions": torch.tensor([30, 45, 63]), "queries": torch.randn(2, 3, 8) * 2,
              "keys": torch.randn(1, 64, 8), "value_norms": torch.rand(1, 64)}
    got = sequence_loss(layer, config, sample)
    logits = signature_logits(layer, sample["queries"], sample["keys"], 0.0)
    total, count = 0.0, 0
    for h in range(2):
        for r, p in enumerate(sample["query_positions"].tolist()):
            dots = {j: float(sample["queries"][h, r] @ sample["keys"][0, j]) / math.sqrt(8) for j in range(p + 1)}
            normaliser = sum(math.exp(d) for d in dots.values())
            candidates = list(range(2, p - 2 + 1))
            top = sorted(candidates, key=lambda j: -dots[j])[:4]
            top_mass = sum(math.exp(dots[j]) / normaliser for j in top)
            for j in candidates:
                z = float(logits[h, r, j].detach())
                if j in top:
                    scale = (1 - mix) + mix * 4 * (math.exp(dots[j]) / normaliser) / top_mass
                    total += 3.0 * scale * math.log1p(math.exp(-z))
                else:
                    total += math.log1p(math.exp(z))
                count += 1
    assert got.item() == pytest.approx(total / count, rel=1e-5)


def test_attention_positive_scale_averages_one_and_reduces_to_uniform():
    from train.labels import attention_positive_scale, causal_keys, eligible_keys, top_k_labels

    torch.manual_seed(6)
    scores = torch.randn(3, 5, 40) * 3
    positions = torch.tensor([20, 25, 30, 35, 39])
    eligible, causal = eligible_keys(positions, 40, 2, 2), causal_keys(positions, 40)
    labels = top_k_labels(scores, eligible, 6)
    for mix in (0.0, 0.4, 1.0):
        scale = attention_positive_scale(scores, labels, causal, mix)
        assert torch.all(scale[~labels] == 0)
        mean = scale.sum(-1) / labels.sum(-1)
        torch.testing.assert_close(mean, torch.ones_like(mean))
    torch.testing.assert_close(attention_positive_scale(scores, labels, causal, 0.0), labels.float())
    full = attention_positive_scale(scores, labels, causal, 1.0)  # ordered like the scores among positives
    row_scores, row_scale = scores[0, 0][labels[0, 0]], full[0, 0][labels[0, 0]]
    assert torch.equal(row_scores.argsort(), row_scale.argsort())
    with pytest.raises(ValueError, match="mix"):
        attention_positive_scale(scores, labels, causal, 1.5)
    with pytest.raises(ValueError, match="positive_attention_mix"):
        TrainConfig(positive_attention_mix=-0.1)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="bits"):
        TrainConfig(bits=48)
    with pytest.raises(ValueError, match="key_heads"):
        TrainConfig(key_heads="both")
    with pytest.raises(ValueError, match="queries per sequence"):
        TrainConfig(sequence_tokens=64, queries_per_sequence=60)
