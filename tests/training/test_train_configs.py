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
