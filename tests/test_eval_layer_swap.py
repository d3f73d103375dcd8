"""scripts/eval_layer_swap.py: HashAttention with the exact top-k in chosen layers, on the prompts it loses."""

import importlib.util
import json
import os

import pytest
import torch

from evaluation_helpers import tiny_corpus, tiny_model
from hashattention.adapters import HashAdapters
from hashattention.evaluation import cli
from hashattention.evaluation.selectors import Budget, ModelShape, SelectorSetup, create_selector

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "eval_layer_swap.py")


def load_script():
    spec = importlib.util.spec_from_file_location("eval_layer_swap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _adapters(model, directory):
    torch.manual_seed(3)
    HashAdapters.for_model_config(model.config, key_heads="query", hidden_features=(16,)).save_pretrained(directory)
    return directory


def test_layer_groups_parse_and_bad_groups_are_named(script):
    assert script.parse_layer_groups("0-1, 3", 4) == [("0-1", [0, 1]), ("3", [3])]
    assert script.parse_layer_groups(" ", 4) == []  # head sets alone
    for bad, match in (("0-4", "outside"), ("a-b", "not a layer"), ("2-1", "outside")):
        with pytest.raises(ValueError, match=match):
            script.parse_layer_groups(bad, 4)


def test_head_sets_parse_and_bad_sets_are_named(script):
    assert script.parse_head_sets("copy-27, random-3") == [("copy", 27), ("random", 3)]
    assert script.parse_head_sets("") == []
    for bad in ("copy", "copy-0", "top-3", "random-x", "copy--1"):
        with pytest.raises(ValueError, match="copy-N or random-N"):
            script.parse_head_sets(bad)


def test_chosen_heads_are_the_highest_copy_scores_or_a_seeded_draw(script):
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.2, 0.8]])
    assert script.choose_heads("copy", 3, scores) == [(0, 1), (1, 0), (1, 2)]
    drawn = script.choose_heads("random", 4, scores, seed=5)
    assert drawn == script.choose_heads("random", 4, scores, seed=5) and len(set(drawn)) == 4
    assert all(0 <= layer < 2 and 0 <= head < 3 for layer, head in drawn)
    with pytest.raises(ValueError, match="more than the model's 6 heads"):
        script.choose_heads("copy", 7, scores)


def test_copy_scores_match_the_models_own_attention_weights(script, model):
    period = 24
    scores = script.copy_head_scores(model, period=period, seed=2)
    assert scores.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    # Reference: the same tokens through the model's eager attention, which returns its weights.
    vocab = model.config.vocab_size
    tokens = torch.randint(vocab // 10, vocab, (period,), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([tokens, tokens]).view(1, -1)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    rows = torch.arange(period, 2 * period - 1)
    expected = torch.stack([a[0][:, rows, rows - period + 1].double().mean(-1) for a in attentions])
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(expected, expected.mean())  # heads differ, so a swapped index would show


def _prepared_with_inputs(mixed, model, directory, seed):
    """``(plain, oracle, mixed, query, key, shape)``: the three selectors prepared on random adapters,
    and random post-RoPE queries (3 rows) and keys (200) of the tiny model's shape."""
    setup = SelectorSetup(shape=ModelShape.from_config(model.config), adapters_dir=_adapters(model, directory))
    plain, oracle = create_selector("hashattention"), create_selector("oracle")
    for selector in (plain, oracle, mixed):
        selector.prepare(setup)
        selector.start_sequence()
    g = torch.Generator().manual_seed(seed)
    shape = setup.shape
    query = torch.randn(1, shape.num_query_heads, 3, shape.head_dim, generator=g)
    key = torch.randn(1, shape.num_kv_heads, 200, shape.head_dim, generator=g)
    return plain, oracle, mixed, query, key, shape


def test_swapped_heads_select_as_the_oracle_and_the_others_as_hashattention(script, model, tmp_path):
    plain, oracle, mixed, query, key, shape = _prepared_with_inputs(
        script.OracleInHeads([(1, 2), (1, 0)]), model, str(tmp_path / "a"), seed=1)
    budget = Budget(2, 2, 12)
    for layer, oracle_heads in ((0, ()), (1, (0, 2))):
        learned = plain.select(layer, query, key, key, budget, 0.125)
        exact = oracle.select(layer, query, key, key, budget, 0.125)
        got = mixed.select(layer, query, key, key, budget, 0.125)
        for head in range(shape.num_query_heads):
            reference = exact if head in oracle_heads else learned
            torch.testing.assert_close(got[0][:, head], reference[0][:, head])
            torch.testing.assert_close(got[1][:, head], reference[1][:, head])
        if oracle_heads:  # the two selections differ on the swapped heads, so the test can tell them apart
            assert any(not torch.equal(learned[0][:, h], exact[0][:, h]) for h in oracle_heads)
    assert mixed.identity()["oracle_heads"] == [[1, 0], [1, 2]]


def test_swapped_layers_select_as_the_oracle_and_the_others_as_hashattention(script, model, tmp_path):
    plain, oracle, mixed, query, key, _ = _prepared_with_inputs(
        script.OracleInLayers([1]), model, str(tmp_path / "a"), seed=0)
    budget = Budget(2, 2, 12)
    for layer, reference in ((0, plain), (1, oracle)):
        expected = reference.select(layer, query, key, key, budget, 0.125)
        got = mixed.select(layer, query, key, key, budget, 0.125)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
    # The two selections differ here, so the test can tell which one ran.
    assert not torch.equal(plain.select(1, query, key, key, budget, 0.125)[0],
                           oracle.select(1, query, key, key, budget, 0.125)[0])
    assert mixed.identity()["oracle_layers"] == [1]
    from hashattention.evaluation.selectors import selector_names
    assert not any("oracle-layers" in n for n in selector_names())  # built per group, never by registry name


def test_losing_prompts_are_those_where_the_oracle_scores_higher(script, tmp_path):
    path = tmp_path / "samples.jsonl"
    rows = [("niah_single", 0, "oracle", 1.0), ("niah_single", 0, "hashattention", 0.0),
            ("niah_single", 1, "oracle", 1.0), ("niah_single", 1, "hashattention", 1.0),
            ("vt", 0, "oracle", 0.4), ("vt", 0, "hashattention", 0.2), ("vt", 1, "oracle", 1.0)]
    path.write_text("".join(json.dumps({"kind": "task", "task": t, "context": 1024, "sample": i, "selector": s,
                                        "score": v}) + "\n" for t, i, s, v in rows))
    assert script.losing_prompts(str(path), ("niah_single", "vt")) == [("niah_single", 1024, 0), ("vt", 1024, 0)]
    assert script.losing_prompts(str(path), ("vt",)) == [("vt", 1024, 0)]


def test_end_to_end_on_a_tiny_model(script, model, tmp_path):
    model_dir = str(tmp_path / "model")
    model.save_pretrained(model_dir)
    corpus = tiny_corpus(str(tmp_path / "corpus"))
    adapters = _adapters(model, str(tmp_path / "adapters"))
    out = str(tmp_path / "out")
    common = ["--model", model_dir, "--tokenizer", "byte", "--corpus", corpus, "--held-out-modulus", "2",
              "--contexts", "1024", "--sparsities", "32", "--tasks", "niah_single", "--task-samples", "2",
              "--nll-samples", "0", "--sparse-prompt-tokens", "8", "--max-new-tokens", "2",
              "--calibration-tokens", "128", "--adapters", adapters, "--output-dir", out, "--no-progress"]
    assert cli.main(common + ["--selectors", "full,oracle,hashattention"]) == 0
    samples = os.path.join(out, "samples.jsonl")
    with open(samples) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:  # make sample 1 a prompt the oracle wins, so the script reruns it
        if row["sample"] == 1:
            row["score"] = 1.0 if row["selector"] == "oracle" else 0.0
    with open(samples, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert script.main(common + ["--layer-groups", "0,1"]) == 0
    with open(samples) as f:
        added = [json.loads(line) for line in f][len(rows):]
    assert sorted(r["selector"] for r in added) == ["hashattention-group", "hashattention-oracle-layers-0",
                                                    "hashattention-oracle-layers-1"]  # the control ran too
    assert all(r["sample"] == 1 and r["task"] == "niah_single" for r in added)
    with open(os.path.join(out, "layer_swap.md")) as f:
        report = f.read()
    assert "| oracle | 1.00 | 100% |" in report and "| hashattention | 0.00 | 0% |" in report
    assert "hashattention-oracle-layers-1" in report and "| hashattention-group |" in report
    # Resumes: a second run computes nothing new.
    assert script.main(common + ["--layer-groups", "0,1"]) == 0
    with open(samples) as f:
        assert len(f.read().splitlines()) == len(rows) + 3
    # Head sets alone: two more rows, the layer-group rows reused from the cache.
    assert script.main(common + ["--layer-groups", "", "--head-sets", "copy-2,random-2"]) == 0
    with open(samples) as f:
        added = [json.loads(line) for line in f][len(rows) + 3:]
    assert sorted(r["selector"] for r in added) == ["hashattention-oracle-heads-copy-2",
                                                    "hashattention-oracle-heads-random-2"]
    with pytest.raises(SystemExit, match="nothing to swap"):
        script.main(common + ["--layer-groups", ""])
