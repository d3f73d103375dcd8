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
    for bad, match in (("0-4", "outside"), ("a-b", "not a layer"), ("2-1", "outside"), ("", "at least one")):
        with pytest.raises(ValueError, match=match):
            script.parse_layer_groups(bad, 4)


def test_swapped_layers_select_as_the_oracle_and_the_others_as_hashattention(script, model, tmp_path):
    setup = SelectorSetup(shape=ModelShape.from_config(model.config), adapters_dir=_adapters(model, str(tmp_path / "a")))
    plain, oracle, mixed = create_selector("hashattention"), create_selector("oracle"), script.OracleInLayers([1])
    for selector in (plain, oracle, mixed):
        selector.prepare(setup)
        selector.start_sequence()
    g = torch.Generator().manual_seed(0)
    shape = setup.shape
    query = torch.randn(1, shape.num_query_heads, 3, shape.head_dim, generator=g)
    key = torch.randn(1, shape.num_kv_heads, 200, shape.head_dim, generator=g)
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
