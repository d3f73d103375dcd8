"""The evaluation hook on a tiny random-weight Llama, and the whole command end to end."""

import copy
import json
import os

import pytest
import torch
from transformers import DynamicCache

from evaluation_helpers import tiny_corpus, tiny_model
from hashattention.adapters import HashAdapters
from hashattention.evaluation import cli, metrics
from hashattention.evaluation.attention_hook import SparseRun, activate, evaluation_attention
from hashattention.evaluation.selectors import Budget, ModelShape, SelectorSetup, create_selector


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _ids(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, length), generator=g)


def _prepared(model, name):
    selector = create_selector(name)
    selector.prepare(SelectorSetup(shape=ModelShape.from_config(model.config)))
    selector.start_sequence()
    return selector


@torch.no_grad()
def test_full_budget_equals_dense_model(model):
    """Sparse rows with a budget covering every key reproduce the SDPA model's logits."""
    ids = _ids(96)
    dense = model(ids).logits
    selector = _prepared(model, "oracle")
    recorder = metrics.SelectionRecorder(sink_tokens=2, local_tokens=2, top_k=8)
    with evaluation_attention(model), activate(SparseRun(selector, Budget(2, 2, 200), 40, recorder)):
        sparse = model(ids).logits
    torch.testing.assert_close(sparse, dense, atol=2e-4, rtol=2e-4)
    assert recorder.per_layer()["recall"] == [1.0, 1.0]
    assert recorder.per_layer()["mass"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert model.config._attn_implementation == "sdpa"  # restored


@torch.no_grad()
def test_small_budget_changes_the_output(model):
    ids = _ids(96, seed=1)
    dense = model(ids).logits
    selector = _prepared(model, "streaming")
    with evaluation_attention(model), activate(SparseRun(selector, Budget(2, 2, 4), 40)):
        sparse = model(ids).logits
    torch.testing.assert_close(sparse[:, :40], dense[:, :40], atol=2e-4, rtol=2e-4)  # dense rows untouched
    assert (sparse[:, 40:] - dense[:, 40:]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["lsh-32", "h2o", "quest"])
@torch.no_grad()
def test_chunked_teacher_forcing_equals_step_by_step_decoding(model, name):
    """The harness decodes the NLL tail as one chunk; that must equal decoding it token by token."""
    ids = _ids(80, seed=2)
    prefix, budget = 60, Budget(2, 3, 6)
    selector = _prepared(model, name)
    with evaluation_attention(model):
        cache = DynamicCache(config=model.config)
        with activate(SparseRun(selector, None, None)):
            model(ids[:, :prefix], past_key_values=cache, use_cache=True)
        state = selector.save_state()
        with activate(SparseRun(selector, budget, prefix)):
            chunk = model(ids[:, prefix:], past_key_values=copy.deepcopy(cache), use_cache=True).logits
        selector.load_state(state)
        steps = []
        with activate(SparseRun(selector, budget, prefix)):
            for position in range(prefix, ids.shape[1]):
                steps.append(model(ids[:, position : position + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(chunk, torch.cat(steps, dim=1), atol=2e-4, rtol=2e-4)


def _write_adapters(model, directory, key_heads):
    torch.manual_seed(3)
    HashAdapters.for_model_config(model.config, key_heads=key_heads, hidden_features=(16,)).save_pretrained(directory)
    return directory


def test_command_end_to_end_and_resume(model, tmp_path, monkeypatch):
    model_dir = str(tmp_path / "model")
    model.save_pretrained(model_dir)
    corpus = tiny_corpus(str(tmp_path / "corpus"))
    adapters = _write_adapters(model, str(tmp_path / "adapters"), "query")
    group_adapters = _write_adapters(model, str(tmp_path / "group"), "kv")
    out = str(tmp_path / "out")
    args = [
        "--model", model_dir, "--tokenizer", "byte", "--corpus", corpus, "--held-out-modulus", "2",
        "--contexts", "1024", "--sparsities", "4,8", "--tasks", "niah_single,vt", "--task-samples", "1",
        "--nll-samples", "1", "--nll-tokens", "12", "--sparse-prompt-tokens", "8", "--max-new-tokens", "2",
        "--calibration-tokens", "128", "--adapters", adapters, "--group-adapters", group_adapters,
        "--output-dir", out, "--no-progress",
    ]
    assert cli.main(args) == 0
    for name in ("results.md", "results.json", "recall_vs_sparsity.png", "task_score_vs_sparsity.png",
                 "recall_per_layer.png", "samples.jsonl"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    rows = {(r["selector"], r["sparsity"]): r for r in results["rows"]}
    selectors = [s for s in results["selectors"]]
    assert all(results["selectors"][s]["available"] for s in selectors), results["selectors"]
    assert len(rows) == 1 + 2 * (len(selectors) - 1)  # full once, every other selector at 4x and 8x
    assert rows[("full", None)]["recall"] == 1.0 and rows[("full", None)]["delta_nll"] == 0.0
    # 1024 // 4 - 16 = 240 heavy tokens >= 32: the oracle holds the true top-32 exactly
    assert rows[("oracle", 4.0)]["recall"] == 1.0
    assert rows[("hashattention", 4.0)]["tasks"].keys() == {"niah_single", "vt"}
    for (name, sparsity), row in rows.items():
        assert 0.0 <= row["recall"] <= 1.0 and 0.0 < row["mass"] <= 1.0 + 1e-6, (name, sparsity)
        assert len(row["recall_per_layer"]) == 2
        if name not in ("full", "oracle"):  # not the oracle: attention mass at 8x is below the dense one
            assert row["mass"] < 1.0
    with open(os.path.join(out, "samples.jsonl")) as f:
        lines = f.read().splitlines()
    assert len(lines) == len(rows) * 3  # nll + two tasks per (selector, sparsity)

    # Resume: drop the last two records as if interrupted; only those are recomputed.
    with open(os.path.join(out, "samples.jsonl"), "w") as f:
        f.write("\n".join(lines[:-2]) + "\n")
    assert cli.main(args) == 0
    with open(os.path.join(out, "samples.jsonl")) as f:
        resumed = f.read().splitlines()
    assert resumed[:-2] == lines[:-2] and len(resumed) == len(lines)
    assert [json.loads(l)["key"] for l in resumed[-2:]] == [json.loads(l)["key"] for l in lines[-2:]]
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f)["rows"] == results["rows"]  # deterministic: the same numbers again

    # --report-only on a larger grid computes nothing and leaves the new cells empty; it reads the
    # model's config but not its weights.
    def no_weights(name, tokenizer_kind):
        raise AssertionError("--report-only loaded the model's weights")

    monkeypatch.setattr(cli, "load_model", no_weights)
    widened = [a if a != "4,8" else "4,8,16" for a in args] + ["--report-only"]
    assert cli.main(widened) == 0
    with open(os.path.join(out, "samples.jsonl")) as f:
        assert len(f.read().splitlines()) == len(lines)
    with open(os.path.join(out, "results.json")) as f:
        wide = {(r["selector"], r["sparsity"]): r for r in json.load(f)["rows"]}
    assert wide[("lsh-32", 16.0)]["recall"] is None and wide[("lsh-32", 4.0)] == rows[("lsh-32", 4.0)]
    assert all(wide[cell] == row for cell, row in rows.items())  # every selector found its cached results


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for option in ("--selectors", "--contexts", "--sparsities", "--tasks", "--seed", "--output-dir", "--adapters"):
        assert option in text


@pytest.mark.parametrize("name", ["oracle", "h2o"])
@torch.no_grad()
def test_a_chunk_after_cached_keys_with_dense_and_sparse_rows_matches_the_dense_model(model, name):
    """The rows of a chunk that follows cached keys: the dense ones see the cache through SDPA's mask, and
    the sparse ones, under a budget covering every key (one row at a time for H2O), give the dense logits."""
    ids = _ids(90, seed=4)
    dense = model(ids).logits
    selector = _prepared(model, name)
    with evaluation_attention(model):
        cache = DynamicCache(config=model.config)
        with activate(SparseRun(selector, None, None)):
            model(ids[:, :50], past_key_values=cache, use_cache=True)
        recorder = metrics.SelectionRecorder(sink_tokens=2, local_tokens=2, top_k=8)
        with activate(SparseRun(selector, Budget(2, 2, 200), 70, recorder)):
            chunk = model(ids[:, 50:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(chunk, dense[:, 50:], atol=2e-4, rtol=2e-4)
    assert recorder.per_layer()["recall"] == [1.0, 1.0]


@torch.no_grad()
def test_task_prompt_selection_diagnostic(model, tmp_path):
    """Evaluation.task_prompt_selection: the oracle holds the true top-k at the question rows, a small budget
    does not; the needle's attention is all kept at a full budget."""
    model_dir = str(tmp_path / "model")
    model.save_pretrained(model_dir)
    corpus = tiny_corpus(str(tmp_path / "corpus"))
    args = cli.build_parser().parse_args([
        "--model", model_dir, "--tokenizer", "byte", "--corpus", corpus, "--held-out-modulus", "2",
        "--contexts", "1024", "--sparsities", "1,4,64", "--tasks", "niah_single", "--task-samples", "1",
        "--sparse-prompt-tokens", "8", "--calibration-tokens", "128", "--selectors", "full,oracle,streaming",
        "--output-dir", str(tmp_path / "out"), "--no-progress",
    ])
    quality = cli.evaluation_from_args(args).task_prompt_selection("niah_single", 1024, 0)
    rows = {job: (metrics.mean_ignoring_none(layers["recall"]), metrics.mean_ignoring_none(layers["mass"]),
                  layers["needle_kept"]) for job, layers in quality.items()}
    assert ("full", None) not in rows  # the full model selects everything: no row
    assert rows[("oracle", 4.0)][0] == 1.0  # 1024 // 4 - 16 heavy tokens >= 32: the true top-32 exactly
    assert rows[("streaming", 64.0)][0] < 1.0 and rows[("streaming", 64.0)][1] < 1.0
    # the needle sits mid-haystack: a full budget keeps all the attention to it
    assert rows[("streaming", 1.0)][2] == pytest.approx(1.0) and rows[("oracle", 1.0)][2] == pytest.approx(1.0)


def test_adapter_flags_take_a_directory_or_a_shipped_name(tmp_path):
    from hashattention.adapters import pretrained_names, pretrained_path
    from hashattention.evaluation.cli import adapter_directory

    assert adapter_directory(None, "--adapters") is None
    assert adapter_directory(str(tmp_path), "--adapters") == str(tmp_path)
    name = pretrained_names()[0]
    assert adapter_directory(name, "--adapters") == pretrained_path(name)
    with pytest.raises(ValueError, match="--group-adapters 'no-such-adapters' is neither a directory"):
        adapter_directory("no-such-adapters", "--group-adapters")
