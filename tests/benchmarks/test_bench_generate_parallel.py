"""benchmarks.generate --tensor-parallel on the CPU: two torchrun processes (gloo) sharding the tiny model,
against a single-process run of the same arguments; and the checks of the tensor-parallel arguments."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import generate as bench
from benchmarks import generate_parallel as parallel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --local-tokens: torchrun refuses --local (an ambiguous abbreviation of its own options) anywhere on its line.
TINY = ["--tiny", "--device", "cpu", "--sink", "4", "--local-tokens", "4", "--sparse-prompt-tokens", "8",
        "--new-tokens", "6", "--skip-tokens", "1", "--loop-steps", "2", "--contexts", "64"]
SPARSE = "hash-kv_group-4"
METHODS = ["dense", "hash-query_head-full", SPARSE]
RANKS = 2
# The tiny model's shape (benchmarks.decode_loop.model_config): the embedding table and the norms are
# replicated on every rank, every other weight is split in two.
VOCAB, HIDDEN, LAYERS, FLOAT32 = 512, 256, 2, 4


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"  # two processes on a small host
    return env


def launch(command, out):
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    with open(out / "generate_cpu.json") as f:
        return json.load(f), done.stdout


def torchrun(out, *arguments):
    return launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
                   "-m", "benchmarks.generate", "--tensor-parallel", *TINY, *arguments, "--out", str(out)], out)


def by_key(record):
    return {(r["B"], r["cache"], r["method"]): r for r in record["rows"]}


def expected_rank_bytes(model_bytes: int) -> int:
    replicated = (VOCAB * HIDDEN + HIDDEN * (2 * LAYERS + 1)) * FLOAT32  # embedding, 2 norms a layer, final norm
    return replicated + (model_bytes - replicated) // RANKS


@pytest.mark.slow
def test_tensor_parallel_run_writes_rank_zeros_rows_with_the_single_process_tokens(tmp_path):
    arguments = ["--batches", "2", "--caches", "static,dynamic", "--methods", ",".join(METHODS)]
    record, stdout = torchrun(tmp_path / "tp", *arguments)
    single, _ = launch([sys.executable, "-m", "benchmarks.generate", *TINY, *arguments, "--out",
                        str(tmp_path / "one")], tmp_path / "one")
    # Rank 0 alone writes (and prints): one results pair, each row announced once.
    assert sorted(os.listdir(tmp_path / "tp")) == ["generate_cpu.json", "generate_cpu.md"]
    assert stdout.count("n=64 B=2 tp=2 cache=static dense\n") == 1
    meta = record["meta"]
    assert meta["tensor_parallel"] == RANKS and meta["tp_weights"] == "seeded"
    assert meta["command"].startswith(f"torchrun --nproc_per_node {RANKS} -m benchmarks.generate --tensor-parallel")
    assert meta["rank_parameter_bytes"] == expected_rank_bytes(meta["parameter_bytes"])
    rows, reference = by_key(record), by_key(single)
    assert set(rows) == set(reference) == {(2, c, m) for c in ("static", "dynamic") for m in METHODS}
    for key, row in rows.items():
        assert "skipped" not in row and row["tp"] == RANKS and reference[key]["tp"] == 1, key
        assert len(row["tokens"]) == key[0] and row["decode_ms_per_token"] > 0, key
        # Every rank holds the same gathered logits; rank 0's tokens are the single process's (the same seeded
        # weights and adapters, float32).
        assert row["tokens"] == reference[key]["tokens"], key
        if key[1] == "static":
            assert row["loop_skipped"].startswith("generate compiled no decode step"), key
    for cache in ("static", "dynamic"):
        assert rows[(2, cache, "hash-query_head-full")]["tokens"] == rows[(2, cache, "dense")]["tokens"], cache
    # The sparse budget changes tokens, so the equality above compared selections, not dense attention.
    assert any(rows[(2, c, SPARSE)]["tokens"] != rows[(2, c, "dense")]["tokens"] for c in ("static", "dynamic"))
    markdown = (tmp_path / "tp" / "generate_cpu.md").read_text()
    assert "| 64 | 2 | 2 | static | dense |" in markdown and "tensor parallel: 2 ranks" in markdown


@pytest.mark.slow
def test_sharded_weights_are_initialised_per_rank(tmp_path):
    """Without the seeded whole model each rank allocates and initialises only its shards."""
    record, _ = torchrun(tmp_path, "--tp-weights", "sharded", "--batches", "1", "--caches", "static",
                         "--methods", "dense,hash-query_head-full")
    meta = record["meta"]
    assert meta["tp_weights"] == "sharded"
    assert meta["rank_parameter_bytes"] == expected_rank_bytes(meta["parameter_bytes"])
    rows = by_key(record)
    assert rows[(1, "static", "hash-query_head-full")]["tokens"] == rows[(1, "static", "dense")]["tokens"]


def test_tensor_parallel_needs_torchrun(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="--tensor-parallel needs a torchrun launch"):
        bench.main(["--tensor-parallel", *TINY])


@pytest.fixture
def torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")


def test_heads_must_divide_by_the_ranks(torchrun_environment):
    config = parallel.model_config(bench.parse_args(TINY), 128)  # 4 query / 2 KV heads over 3 ranks
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) to be divisible by 3"):
        parallel.check_launch(config, None)


def test_device_is_the_one_transformers_places_the_rank_on(torchrun_environment, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = parallel.model_config(bench.parse_args(TINY), 128)
    other = "cpu" if parallel.torch._C._get_accelerator().type != "cpu" else "cuda"
    with pytest.raises(ValueError, match=f"--device {other} cannot be honoured"):
        parallel.check_launch(config, other)


def test_model_shapes():
    big = parallel.model_config(bench.parse_args(["--model", "llama-70b-shape"]), 1024)
    assert (big.num_attention_heads, big.num_key_value_heads, big.num_hidden_layers, big.hidden_size,
            big.intermediate_size, big.vocab_size, big.head_dim) == (64, 8, 80, 8192, 28672, 128256, 128)
    default = parallel.model_config(bench.parse_args([]), 1024)
    assert (default.num_attention_heads, default.num_hidden_layers, default.hidden_size) == (32, 32, 4096)
    assert parallel.model_config(bench.parse_args(["--model", "llama-70b-shape", "--layers", "2"]),
                                 1024).num_hidden_layers == 2


@pytest.mark.parametrize("arguments, message", [
    (["--tiny", "--model", "llama-8b-shape"], "the tiny model has its own shape"),
    (["--tp-weights", "sharded"], "--tp-weights needs --tensor-parallel"),
])
def test_argument_errors(arguments, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(arguments)
    assert message in capsys.readouterr().err
