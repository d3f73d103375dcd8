"""An interrupted and resumed fit ends with bit-identical weights to an uninterrupted one (tiny model)."""

import os
import shutil

import pytest
import torch

from train.__main__ import main
from train_helpers import tiny_run_flags, write_tiny_llama


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_resume")
    model_dir = write_tiny_llama(str(root / "model"))
    work = str(root / "collected")
    assert main(["collect", *tiny_run_flags(model_dir, work, threads=0)]) == 0
    return model_dir, work


def _fresh_work_dir(collected, path):
    shutil.copytree(os.path.join(collected[1], "shards"), os.path.join(path, "shards"))
    return str(path)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_resumed_fit_is_bit_identical(collected, tmp_path):
    model_dir = collected[0]
    straight = _fresh_work_dir(collected, tmp_path / "straight")
    interrupted = _fresh_work_dir(collected, tmp_path / "interrupted")
    assert main(["fit", *tiny_run_flags(model_dir, straight, threads=0)]) == 0
    # 2 layers x 2 epochs x 3 sequences = 12 steps; stop mid-epoch, then across the layer boundary.
    assert main(["fit", *tiny_run_flags(model_dir, interrupted, threads=0), "--stop-after-steps", "4"]) == 0
    assert not os.path.exists(os.path.join(interrupted, "adapters"))
    with pytest.raises(ValueError, match="--resume"):
        main(["fit", *tiny_run_flags(model_dir, interrupted, threads=0)])
    assert main(["fit", *tiny_run_flags(model_dir, interrupted, threads=0), "--resume", "--stop-after-steps", "5"]) == 0
    assert os.path.exists(os.path.join(interrupted, "layers", "layer000.safetensors"))
    assert not os.path.exists(os.path.join(interrupted, "layers", "layer001.safetensors"))
    assert main(["fit", *tiny_run_flags(model_dir, interrupted, threads=0), "--resume"]) == 0
    for layer in (0, 1):
        name = os.path.join("layers", f"layer{layer:03d}.safetensors")
        assert _read(os.path.join(straight, name)) == _read(os.path.join(interrupted, name)), name
    assert _read(os.path.join(straight, "adapters", "adapters.safetensors")) == \
        _read(os.path.join(interrupted, "adapters", "adapters.safetensors"))
    # the checkpoints hold the same optimizer state too
    a = torch.load(os.path.join(straight, "checkpoints", "layer001.pt"), weights_only=True)
    b = torch.load(os.path.join(interrupted, "checkpoints", "layer001.pt"), weights_only=True)
    assert a["step"] == b["step"] == 6 and a["history"] == b["history"]
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg_sq"], b["optimizer"]["state"][key]["exp_avg_sq"])


def test_training_changes_the_weights_and_lowers_the_loss(collected, tmp_path):
    work = _fresh_work_dir(collected, tmp_path / "longer")
    assert main(["fit", *tiny_run_flags(collected[0], work, threads=0, epochs=6)]) == 0
    history = torch.load(os.path.join(work, "checkpoints", "layer000.pt"), weights_only=True)["history"]
    assert sum(history[-3:]) < sum(history[:3])
