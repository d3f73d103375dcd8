"""Every recipe under train/configs/ loads and validates: unknown keys, bad values and query windows
too short for the sampled queries fail here, not an hour into a run."""

import glob
import os

import pytest

from train.config import TrainConfig

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "train", "configs", "*.toml")))
SHIPPED_RECIPE = "smollm2-135m-instruct-retrieval-facts.toml"  # hashattention/pretrained/smollm2-135m-instruct/


def test_the_shipped_recipe_is_found():
    assert SHIPPED_RECIPE in [os.path.basename(path) for path in CONFIGS], CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_recipe_loads_and_validates(path):
    config = TrainConfig(**TrainConfig.from_file(path))  # the constructor validates
    assert config.sequence_tokens - config.first_query_position >= config.queries_per_sequence


def test_shipped_recipe_matches_the_shipped_adapters():
    """The recipe file reproduces the adapters it names: every setting it holds (paths aside) equals the
    one recorded in their adapter_config.json at training time."""
    import json

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "hashattention", "pretrained", "smollm2-135m-instruct", "adapter_config.json")) as f:
        recorded = json.load(f)["training"]["recipe"]
    recipe = TrainConfig.from_file(os.path.join(root, "train", "configs", SHIPPED_RECIPE))
    settings = {name: value for name, value in recipe.items() if name not in ("work_dir", "output_dir")}
    assert settings == {name: recorded[name] for name in settings}


@pytest.mark.parametrize("values, message", [
    ({"epochs": 2.5}, "epochs must be a whole number"),  # int(2.5) would train 2 epochs
    ({"sparsities": [8.5, 16]}, "sparsities must be a whole number"),
    ({"hidden_features": [128.5]}, "hidden_features must be a whole number"),
    ({"layers": [-1]}, "layers must be distinct layer indices >= 0"),
    ({"layers": []}, "layers must be distinct layer indices >= 0"),
    ({"top_k": True}, "top_k must be a whole number"),
    ({"sparsities": 8}, "sparsities must be a list of integers"),
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number"),
    ({"threshold": float("-inf")}, "threshold must be a finite number"),
    ({"beta": float("nan")}, "beta must be a finite number"),
    ({"alpha": 0.0, "beta": 0.0}, "alpha and beta must be >= 0 and not both 0"),
    ({"model": 3}, "model must be a string"),
    ({"activation": "swish"}, "activation must be one of"),
    ({"tokenizer": "byte"}, "tokenizer must be one of"),
])
def test_values_that_would_change_silently_are_refused_naming_the_field(values, message):
    with pytest.raises(ValueError, match=f"TrainConfig.{message}"):
        TrainConfig(**values)


def test_whole_numbers_written_as_floats_are_accepted():
    config = TrainConfig(epochs=3.0, sparsities=[8.0, 16], alpha=20)
    assert config.epochs == 3 and isinstance(config.epochs, int) and config.sparsities == (8, 16)
    assert isinstance(config.alpha, float)
