"""The whole CLI end to end on a tiny random-weight model: one process, and two with torchrun (gloo)."""

import json
import os
import subprocess

import pytest

from hashattention.adapters import HashAdapters
from train_helpers import PYTHON, REPO_ROOT, subprocess_env, tiny_run_flags, write_tiny_llama


def _run(args, timeout=240):
    result = subprocess.run(args, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_help_lists_every_subcommand_and_option():
    out = _run([PYTHON, "-m", "train", "--help"]).stdout
    for command in ("collect", "fit", "validate", "run"):
        assert command in out
    out = _run([PYTHON, "-m", "train", "fit", "--help"]).stdout
    for flag in ("--config", "--resume", "--alpha", "--beta", "--bits", "--hidden-features", "--learning-rate",
                 "--seed", "--work-dir", "--stop-after-steps"):
        assert flag in out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("train_cli") / "model"))


def _check_outputs(work_dir):
    adapters = HashAdapters.from_pretrained(os.path.join(work_dir, "adapters"))
    assert adapters.config.num_layers == 2 and adapters.config.num_query_heads == 4
    assert adapters.config.training["command"].split()[-2:] == ["--work-dir", work_dir]
    mean = adapters.config.validation["mean"]
    assert set(mean) >= {"learned", "lsh", "oracle"}
    for method in mean.values():
        assert all(0.0 <= v <= 1.0 for v in method.values())
    with open(os.path.join(work_dir, "validation", "recall.json")) as f:
        assert set(json.load(f)["per_layer"]) == {"0", "1"}
    for name in ("recall_per_layer.png", "recall_vs_budget.png", "table.md"):
        assert os.path.getsize(os.path.join(work_dir, "validation", name)) > 0
    with open(os.path.join(work_dir, "adapters", "adapters.safetensors"), "rb") as f:
        return f.read()


def test_cli_end_to_end_single_process_and_torchrun(tiny_model, tmp_path):
    single = str(tmp_path / "single")
    result = _run([PYTHON, "-m", "train", "run", *tiny_run_flags(tiny_model, single)])
    assert "| learned |" in result.stdout
    weights_single = _check_outputs(single)
    # Config file + flag override: the file says 1 epoch, the flag restores 2.
    config_file = tmp_path / "recipe.toml"
    config_file.write_text('epochs = 1\nsink_tokens = 4\n')
    sharded = str(tmp_path / "sharded")
    _run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533", "-m", "train",
          "run", "--config", str(config_file), *tiny_run_flags(tiny_model, sharded)])
    # Layers are independent and seeded per layer: sharding them across processes changes nothing.
    assert _check_outputs(sharded) == weights_single
    with open(os.path.join(sharded, "adapters", "adapter_config.json")) as f:
        recorded = json.load(f)["training"]
    assert recorded["command"].startswith("torchrun --nproc_per_node 2 -m train run --config")
    assert recorded["recipe"]["epochs"] == 2
