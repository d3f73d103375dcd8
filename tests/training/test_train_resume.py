"""An interrupted and resumed fit ends with bit-identical weights to an uninterrupted one (tiny model); a
resume with other recipe settings is refused, naming each; damaged checkpoints and shards are named."""

import os
import shutil

import pytest
import torch

from train.__main__ import main
from train_helpers import tiny_run_flags


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


def _flags(collected, work, **overrides):
    return tiny_run_flags(collected[0], work, **{"threads": 0, **overrides})


def test_resume_with_other_recipe_settings_is_refused_naming_each(collected, tmp_path):
    """Adam would go on at the checkpoint's learning rate and the step count would follow the old epochs,
    while adapter_config.json recorded the new values: refused, with both values of every difference."""
    work = _fresh_work_dir(collected, tmp_path / "work")
    assert main(["fit", *_flags(collected, work), "--stop-after-steps", "4"]) == 0
    with pytest.raises(ValueError) as refused:
        main(["fit", *_flags(collected, work, **{"learning-rate": 0.5, "epochs": 3}), "--resume"])
    message = str(refused.value)
    assert "learning_rate: checkpoint 0.001, now 0.5" in message and "epochs: checkpoint 2, now 3" in message
    assert "alpha" not in message.split("(only")[0]  # only the settings that differ
    # Finished layers are reused without --resume: the same refusal, not a silent reassembly.
    assert main(["fit", *_flags(collected, work), "--resume"]) == 0
    with pytest.raises(ValueError, match=r"hidden_features: checkpoint \[16\], now \[8\]"):
        main(["fit", *_flags(collected, work, **{"hidden-features": 8})])
    with open(os.path.join(work, "adapters", "adapter_config.json")) as f:
        assert '"learning_rate": 0.001' in f.read()


def test_resume_may_change_how_the_run_goes_and_stays_bit_identical(collected, tmp_path):
    straight = _fresh_work_dir(collected, tmp_path / "straight")
    resumed = _fresh_work_dir(collected, tmp_path / "resumed")
    assert main(["fit", *_flags(collected, straight)]) == 0
    assert main(["fit", *_flags(collected, resumed), "--stop-after-steps", "3"]) == 0
    changed = {"threads": 1, "checkpoint-every": 5, "save-dtype": "float32", "sparsities": [4, 8],
               "validation-sequences": 1, "output-dir": str(tmp_path / "elsewhere")}
    assert main(["fit", *_flags(collected, resumed, **changed), "--resume", "--stop-after-steps", "2"]) == 0
    assert main(["fit", *_flags(collected, resumed, **changed), "--resume"]) == 0
    for layer in (0, 1):
        name = os.path.join("layers", f"layer{layer:03d}.safetensors")
        assert _read(os.path.join(straight, name)) == _read(os.path.join(resumed, name)), name
    assert os.path.exists(os.path.join(tmp_path, "elsewhere", "adapters.safetensors"))


def test_a_damaged_checkpoint_is_named(collected, tmp_path):
    work = _fresh_work_dir(collected, tmp_path / "work")
    assert main(["fit", *_flags(collected, work), "--stop-after-steps", "2"]) == 0
    checkpoint = os.path.join(work, "checkpoints", "layer000.pt")
    with open(checkpoint, "r+b") as f:
        f.write(b"\0" * 64)
    with pytest.raises(ValueError, match="cannot read checkpoint " + checkpoint):
        main(["fit", *_flags(collected, work), "--resume"])


def test_a_damaged_shard_is_named(collected, tmp_path):
    work = _fresh_work_dir(collected, tmp_path / "work")
    shard = os.path.join(work, "shards", "train", "00001.safetensors")
    with open(shard, "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.raises(ValueError, match="cannot read shard " + shard):
        main(["fit", *_flags(collected, work)])
