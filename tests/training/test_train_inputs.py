"""Bad settings fail before any expensive work (loading the model, collecting), with a message that
names the setting; missing or mismatched shards say what to run or which settings differ."""

import dataclasses
import os
import shutil

import pytest

import train.model
from train.__main__ import main
from train.collect import COLLECTION_FIELDS
from train.config import TrainConfig
from train.fit import FIT_FIELDS, RESUMABLE_FIELDS
from train_helpers import tiny_run_flags


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(config):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(train.model, "load_model_and_tokenizer", refuse)


@pytest.mark.parametrize("overrides, message", [
    ({"activation": "swish"}, r"activation must be one of .*'swish'"),
    ({"tokenizer": "byte"}, r"tokenizer must be one of .*'byte'"),
    ({"layers": 2}, r"layers: 2 is not a layer of the model \(0..1\)"),
    ({"layers": [0, 0]}, r"layers must be distinct"),
    ({"max-position-offset": 400}, r"sequence_tokens \(192\) \+ max_position_offset \(400\) = 592 positions exceed "
                                   r"the model's max_position_embeddings \(512\)"),
    ({"corpus": "/no/such/corpus"}, r"corpus must be a directory .*'/no/such/corpus'"),
    ({"model": "/no/such/model"}, r"model must be 'smollm2' or a Hugging Face model directory"),
    ({"threads": -1}, r"threads must be >= 0"),
    ({"learning-rate": "nan"}, r"learning_rate must be a finite number"),
    ({"alpha": "inf"}, r"alpha must be a finite number"),
    ({"alpha": -1}, r"alpha and beta must be >= 0"),
    ({"hidden-features": 0}, r"hidden_features must be positive"),
])
def test_run_checks_every_setting_before_loading_the_model(collected, tmp_path, no_model_loading, overrides, message):
    with pytest.raises(ValueError, match=message):
        main(["run", *tiny_run_flags(collected[0], str(tmp_path / "work"), **overrides)])
    assert not os.path.exists(tmp_path / "work" / "shards" / "manifest.json")  # a refused setting is not recorded


def test_a_negative_step_limit_is_a_usage_error(collected, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", *tiny_run_flags(collected[0], str(tmp_path)), "--stop-after-steps", "-1"])
    assert "--stop-after-steps: must be >= 0" in capsys.readouterr().err


def test_fit_without_shards_says_to_collect_first(collected, tmp_path):
    work = str(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"3 of the 3 train shards .* missing from " + work + r".*"
                                         r"run `python -m train collect` \(or `run`\) with --work-dir " + work):
        main(["fit", *tiny_run_flags(collected[0], work)])


def test_a_manifest_mismatch_names_only_the_settings_that_differ(collected, tmp_path):
    work = str(tmp_path / "work")
    shutil.copytree(os.path.join(collected[1], "shards"), os.path.join(work, "shards"))
    for command in ("collect", "fit", "validate"):
        with pytest.raises(ValueError) as refused:
            main([command, *tiny_run_flags(collected[0], work, seed=1, **{"sequence-tokens": 256})])
        listed = str(refused.value).split("other settings: ")[1].split(". Use")[0]
        assert listed == "sequence_tokens: shards 192, requested 256; seed: shards 0, requested 1", command
    # fit and validate compute labels, windows and the recall's k themselves: those may differ from collection.
    config = {"top-k": 4, "sink-tokens": 2, "local-tokens": 2}
    assert main(["fit", *tiny_run_flags(collected[0], work, **config)]) == 0
    assert main(["validate", *tiny_run_flags(collected[0], work, **config)]) == 0


def test_every_setting_is_classified_for_resumption():
    """A new TrainConfig field must be declared as decided by the shards, by the fit, or free to change on resume."""
    fields = [field.name for field in dataclasses.fields(TrainConfig)]
    groups = [set(COLLECTION_FIELDS) - {"sink_tokens", "local_tokens", "top_k", "seed"}, set(FIT_FIELDS),
              set(RESUMABLE_FIELDS)]
    assert sorted(set().union(*groups)) == sorted(fields)
    assert sum(len(group) for group in groups) == len(fields)  # no field in two groups
