"""The evaluation metrics against hand computations."""

import math

import pytest
import torch

from hashattention.evaluation import metrics, report
from hashattention.evaluation.store import ResultStore, record_key


def test_selection_mask_expands_groups_and_skips_padding():
    indices = torch.tensor([[[[0, 2, -1]], [[1, 3, 3]]]], dtype=torch.int32)  # (B=1, Hs=2, P=1, K=3)
    counts = torch.tensor([[[2], [1]]], dtype=torch.int32)
    mask = metrics.selection_mask(indices, counts, keys=4, query_heads=4)
    assert mask.shape == (1, 4, 1, 4)
    expected = [[True, False, True, False]] * 2 + [[False, True, False, False]] * 2
    assert mask[0, :, 0].tolist() == expected


def test_true_logits_are_causal_and_scaled():
    query = torch.tensor([[[[1.0, 0.0]], ]])  # (1, 1, 1, 2): the last of 3 positions
    key = torch.tensor([[[[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]]])
    logits = metrics.true_logits(query, key, scaling=0.5)
    assert logits[0, 0, 0].tolist() == [0.5, 1.0, 1.5]
    two_rows = metrics.true_logits(torch.ones(1, 1, 2, 2), key, scaling=1.0)
    assert two_rows[0, 0, 0, 2].item() == float("-inf") and math.isfinite(two_rows[0, 0, 1, 2].item())


def test_recall_at_k_by_hand():
    # One row at position 9 of 10 keys; sink 1 and local 2 leave positions 1..7 eligible.
    logits = torch.tensor([[[[9.0, 1.0, 5.0, 2.0, 7.0, 0.0, 6.0, 3.0, 8.0, 9.5]]]])
    # true top-3 of the eligible: positions 4 (7.0), 6 (6.0), 2 (5.0); position 0/8/9 are windows
    selected = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    selected[..., [0, 4, 2, 8, 9]] = True
    recall = metrics.recall_at_k(logits, selected, sink_tokens=1, local_tokens=2, k=3)
    assert recall.item() == pytest.approx(2 / 3)
    # fewer eligible keys than k: all of them count
    short = metrics.recall_at_k(logits[..., :5], torch.ones(1, 1, 1, 5, dtype=torch.bool), 1, 2, k=32)
    assert short.item() == 1.0
    # nothing eligible: NaN
    assert math.isnan(metrics.recall_at_k(logits[..., :3], selected[..., :3], 1, 2, k=3).item())


def test_attention_mass_by_hand():
    logits = torch.tensor([[[[0.0, math.log(3.0), float("-inf")]]]])
    selected = torch.tensor([[[[False, True, False]]]])
    assert metrics.attention_mass(logits, selected).item() == pytest.approx(0.75)


def test_recorder_averages_per_layer():
    recorder = metrics.SelectionRecorder(sink_tokens=0, local_tokens=0, top_k=1)
    query = torch.tensor([[[[1.0, 0.0]]]])
    key = torch.tensor([[[[1.0, 0.0], [-1.0, 0.0]]]])
    recorder.record(0, query, key, torch.tensor([[[[True, False]]]]), scaling=1.0)  # hits the top-1: recall 1
    recorder.record(0, query, key, torch.tensor([[[[False, True]]]]), scaling=1.0)  # misses: recall 0
    recorder.record(2, query, key, torch.tensor([[[[True, True]]]]), scaling=1.0)
    result = recorder.per_layer()
    assert result["recall"] == [0.5, None, 1.0]
    p = math.e / (math.e + math.exp(-1))
    assert result["mass"][0] == pytest.approx((p + (1 - p)) / 2)
    assert result["mass"][2] == pytest.approx(1.0)


def test_token_nll_by_hand():
    logits = torch.zeros(2, 4)
    logits[1, 3] = math.log(3.0)  # probabilities 1/6, 1/6, 1/6, 1/2
    nll = metrics.token_nll(logits, torch.tensor([0, 3]))
    assert nll.tolist() == pytest.approx([math.log(4.0), math.log(2.0)])


def test_ruler_string_match():
    assert metrics.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert metrics.string_match_all("ALPHA beta", ["alpha"]) == 1.0
    assert metrics.string_match_part("nothing here", ["123", "here"]) == 1.0
    assert metrics.string_match_part("nothing", ["123"]) == 0.0
    with pytest.raises(ValueError, match="references"):
        metrics.string_match_all("x", [])


def test_store_resumes_and_ignores_other_settings(tmp_path):
    path = str(tmp_path / "samples.jsonl")
    store = ResultStore(path)
    key = record_key("aaa", "nll", 2048, 0, "lsh-32", 16.0)
    assert key == "aaa/nll//2048/0/lsh-32/16x"
    store.add(key, {"value": 1})
    with open(path, "a") as f:
        f.write('{"key": "cut sho')  # an interrupted write
    again = ResultStore(path)
    assert key in again and again.get(key)["value"] == 1 and len(again.records) == 1
    second = record_key("aaa", "task", 2048, 0, "full", None, "vt")
    again.add(second, {"value": 2})
    assert set(ResultStore(path).records) == {key, second}  # the cut line did not swallow the next record
    assert record_key("bbb", "nll", 2048, 0, "lsh-32", 16.0) not in again  # other settings: not reused


def test_markdown_table_rows():
    results = {
        "model": "tiny", "notes": [],
        "config": {"sink_tokens": 8, "local_tokens": 8, "top_k": 32, "nll_tokens": 64, "nll_samples": 1,
                   "task_samples": 1, "sparse_prompt_tokens": 32, "seed": 0, "contexts": [2048], "tasks": ["vt"],
                   "sparsities": [16.0]},
        "selectors": {"full": {"available": True, "aux_bits_per_token": 0.0},
                      "lsh-32": {"available": True, "aux_bits_per_token": 96.0},
                      "hashattention": {"available": False, "reason": "no trained adapters"}},
        "rows": [
            {"context": 2048, "selector": "full", "sparsity": None, "recall": 1.0, "mass": 1.0, "delta_nll": 0.0,
             "task_average": 50.0, "tasks": {"vt": 50.0}},
            {"context": 2048, "selector": "lsh-32", "sparsity": 16.0, "recall": 0.5, "mass": 0.25,
             "delta_nll": 0.125, "task_average": 0.0, "tasks": {"vt": 0.0}},
        ],
    }
    results["rows"][1].update(task_average_se=2.25, task_delta=-50.0, task_delta_se=12.5)
    text = report.markdown(results)
    assert "| full | 0 | dense | 1.000 | 1.000 | +0.000 | 50.0 | – | – | – |" in text
    assert "| lsh-32 | 96 | 16x | 0.500 | 0.250 | +0.125 | 0.0 | 2.2 | -50.0 | 12.5 |" in text
    assert "| lsh-32 | 16x | 0.0 |" in text
    assert "`hashattention` not evaluated: no trained adapters" in text


def test_find_spans_marks_every_occurrence():
    assert metrics.find_spans([5, 1, 2, 3, 1, 2, 9], [1, 2]) == [1, 2, 4, 5]
    assert metrics.find_spans([5, 1, 2], [2, 1]) == [] and metrics.find_spans([1], []) == []


def test_needle_recorder_weighs_kept_attention_by_dense_probability():
    # One KV head, two query heads, 6 keys, the last row at position 5; needle = keys 1 and 2.
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 1, 6, 4, generator=g)
    selected = torch.zeros(1, 2, 1, 6, dtype=torch.bool)
    selected[0, 0, 0, 1] = True  # head 0 keeps needle key 1 only; head 1 keeps neither
    recorder = metrics.NeedleRecorder(0, 0, 2, [2, 1, 1])
    recorder.record(0, query, key, selected, 0.5)
    p = torch.softmax((query.double() @ key.double().transpose(-1, -2)) * 0.5, dim=-1)[0, :, 0]  # (2 heads, 6)
    expected = float(p[0, 1] / (p[0, 1] + p[0, 2] + p[1, 1] + p[1, 2]))
    assert recorder.needle_kept() == pytest.approx(expected, rel=1e-5)
    assert metrics.NeedleRecorder(0, 0, 2, []).needle_kept() is None


def test_task_average_and_its_standard_error_by_hand():
    # Task means 50 and 50; sample variances 5000 (n = 2) and 0 (n = 3): SE = sqrt(5000 / 2 + 0) / 2 = 25.
    average, se = metrics.task_average_with_error({"a": [0.0, 100.0], "b": [50.0, 50.0, 50.0]})
    assert average == pytest.approx(50.0) and se == pytest.approx(25.0)
    assert metrics.task_average_with_error({"a": [100.0], "b": [0.0, 50.0]}) == (pytest.approx(62.5), None)
    assert metrics.task_average_with_error({}) == (None, None)
    assert metrics.task_average_with_error({"a": [], "b": [1.0, 2.0]}) == (None, None)


def test_paired_task_difference_uses_the_common_samples():
    scores = {"a": {0: 100.0, 1: 0.0, 2: 100.0}, "b": {0: 50.0, 1: 50.0}}
    reference = {"a": {0: 100.0, 1: 100.0, 3: 0.0}, "b": {0: 0.0, 1: 100.0}}
    # a: samples 0 and 1 -> differences 0, -100 (mean -50, variance 5000); b: 50, -50 (mean 0, variance 5000).
    delta, se = metrics.paired_task_difference(scores, reference)
    assert delta == pytest.approx(-25.0)
    assert se == pytest.approx(math.sqrt(5000 / 2 + 5000 / 2) / 2)
    assert metrics.paired_task_difference({"a": {5: 1.0}}, reference) == (None, None)  # nothing in common
    same, zero = metrics.paired_task_difference(reference, reference)
    assert same == 0.0 and zero == 0.0

