"""Every argument of the evaluation is checked before the model loads, with a message naming the flag;
``--report-only`` reads the model's config but never its weights."""

import os

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from evaluation_helpers import tiny_corpus, tiny_model
from hashattention.evaluation import cli
from hashattention.evaluation.harness import EvaluationConfig


@pytest.fixture(scope="module")
def model_and_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluation_arguments")
    model_dir = str(root / "model")
    tiny_model().save_pretrained(model_dir)  # max_position_embeddings 4096
    return model_dir, tiny_corpus(str(root / "corpus"))


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(name, tokenizer_kind):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(cli, "load_model", refuse)


def _args(model_and_corpus, tmp_path, *extra):
    model_dir, corpus = model_and_corpus
    return ["--model", model_dir, "--tokenizer", "byte", "--corpus", corpus, "--held-out-modulus", "2",
            "--contexts", "1024", "--sparsities", "4,8", "--tasks", "niah_single", "--task-samples", "1",
            "--nll-samples", "1", "--nll-tokens", "12", "--sparse-prompt-tokens", "8", "--calibration-tokens", "128",
            "--output-dir", str(tmp_path / "out"), "--no-progress", *extra]


@pytest.mark.parametrize("extra, message", [
    (["--sparsities", "nan"], r"sparsities \(--sparsities\) must be distinct finite numbers >= 1 .*nan"),
    (["--sparsities", "inf"], r"sparsities \(--sparsities\) must be distinct finite numbers >= 1 .*inf"),
    (["--sparsities", "0.5"], r"sparsities \(--sparsities\) must be distinct finite numbers >= 1"),
    (["--sparsities", "8,8"], r"sparsities \(--sparsities\) must be distinct"),
    (["--sparsities", ","], r"sparsities \(--sparsities\) must be distinct finite numbers >= 1 .*\[\]"),
    (["--contexts", "0"], r"contexts \(--contexts\) must be distinct positive token counts"),
    (["--contexts", "256", "--nll-tokens", "1000"],
     r"nll_tokens \(--nll-tokens\) \(1000\) must be at most the shortest contexts \(--contexts\) value minus 2 \(254\)"),
    (["--contexts", "256,1024", "--sparse-prompt-tokens", "300"],
     r"sparse_prompt_tokens \(--sparse-prompt-tokens\) \(300\) must be at most the shortest contexts"),
    (["--contexts", "8192"], r"contexts \(--contexts\) \[8192\] exceed the model's max_position_embeddings \(4096\)"),
    (["--calibration-tokens", "5000"], r"calibration_tokens \(--calibration-tokens\) \(5000\) exceeds the model's "
                                       r"max_position_embeddings \(4096\)"),
    (["--top-k", "0"], r"top_k \(--top-k\) must be an integer >= 1"),
    (["--selectors", "oracle,swish"], r"selectors \(--selectors\): unknown \['swish'\]"),
    (["--adapters", "no-such-adapters"], r"--adapters 'no-such-adapters' is neither a directory"),
])
def test_a_bad_argument_fails_before_the_weights_load(model_and_corpus, tmp_path, no_weights, extra, message):
    with pytest.raises(ValueError, match=message):
        cli.main(_args(model_and_corpus, tmp_path, *extra))


def test_a_corpus_without_held_out_text_fails_before_the_weights_load(model_and_corpus, tmp_path, no_weights):
    with pytest.raises(ValueError, match="has no held-out file"):
        cli.main(_args(model_and_corpus, tmp_path, "--held-out-modulus", "1000000"))


def test_a_byte_tokenizer_needs_the_vocabulary_for_it(tmp_path, model_and_corpus, no_weights):
    small = str(tmp_path / "small")
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(small)
    args = _args(model_and_corpus, tmp_path)
    args[args.index("--model") + 1] = small
    with pytest.raises(ValueError, match="--tokenizer byte needs a vocabulary of at least 257 tokens, the model has 256"):
        cli.main(args)


@pytest.mark.parametrize("value", ["-1", "x"])
def test_threads_must_be_a_count(model_and_corpus, tmp_path, no_weights, capsys, value):
    with pytest.raises(SystemExit):
        cli.main(_args(model_and_corpus, tmp_path, "--threads", value))
    assert "argument --threads" in capsys.readouterr().err


def test_a_context_too_short_for_a_task_fails_before_any_sample(model_and_corpus, tmp_path):
    with pytest.raises(ValueError, match=r"contexts \(--contexts\) 64 does not fit task niah_single"):
        cli.main(_args(model_and_corpus, tmp_path, "--contexts", "64", "--calibration-tokens", "32"))
    samples = tmp_path / "out" / "samples.jsonl"
    assert not samples.exists() or samples.read_text() == ""


def test_budgets_that_leave_only_the_windows_are_noted():
    config = EvaluationConfig(output_dir="unused", corpus="unused", contexts=[1024], sparsities=[4, 64],
                              nll_tokens=12, sink_tokens=8, local_tokens=8)
    # n = 1024 - 1 - 12 = 1011 dense tokens: 1011 // 4 = 252 > 16, but 1011 // 64 = 15 <= 16
    notes = config.window_only_budgets()
    assert len(notes) == 1 and "sparsity 64" in notes[0] and "floor(1011 / 64)" in notes[0], notes
    assert EvaluationConfig(output_dir="unused", corpus="unused", contexts=[1024], sparsities=[64],
                            nll_samples=0).window_only_budgets() == []
