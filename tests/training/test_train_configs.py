"""Every recipe under train/configs/ loads and validates: unknown keys, bad values and query windows
too short for the sampled queries fail here, not an hour into a run."""

import glob
import os

import pytest

from train.config import TrainConfig

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "train", "configs", "*.toml")))


def test_the_recipes_are_found():
    assert len(CONFIGS) >= 4, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_recipe_loads_and_validates(path):
    config = TrainConfig(**TrainConfig.from_file(path))  # the constructor validates
    assert config.sequence_tokens - config.first_query_position >= config.queries_per_sequence
