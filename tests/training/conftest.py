"""Fixtures of the training tests."""

import pytest

from train.__main__ import main
from train_helpers import tiny_run_flags, write_tiny_llama


@pytest.fixture(scope="session")
def collected(tmp_path_factory):
    """``(model_dir, work_dir)``: the tiny Llama and a work directory holding the shards of a tiny run."""
    root = tmp_path_factory.mktemp("train_collected")
    model_dir = write_tiny_llama(str(root / "model"))
    work = str(root / "collected")
    assert main(["collect", *tiny_run_flags(model_dir, work, threads=0)]) == 0
    return model_dir, work
