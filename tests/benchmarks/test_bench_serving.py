"""benchmarks.serving on the CPU: a tiny model's concurrent requests through transformers' continuous batching,
dense and patched, its results file and its method names (the GPU numbers come from GPU runs)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import serving as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--tiny", "--device", "cpu", "--sink", "4", "--local", "4", "--sparse-prompt-tokens", "8",
        "--new-tokens", "6", "--warmup-prompt-tokens", "8"]
METHODS = ["dense", "hash-query_head-full", "hash-query_head-4"]


def run(tmp_path, *arguments):
    command = [sys.executable, "-m", "benchmarks.serving", *TINY, *arguments, "--out", str(tmp_path)]
    environment = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=environment)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "serving_cpu.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_cli_end_to_end_tiny_model(tmp_path):
    """Every row is measured through the continuous batching manager; at a budget above every length
    HashAttention gives dense's tokens, a small budget does not; --merge keeps other rows and --render
    rewrites the table."""
    record = run(tmp_path, "--prompt-tokens", "40", "--requests", "3", "--methods", ",".join(METHODS))
    rows = {r["method"]: r for r in record["rows"]}
    assert set(rows) == set(METHODS)
    for name, row in rows.items():
        assert "skipped" not in row, name
        assert row["requests"] == 3 and row["prompt_tokens"] == 40
        assert len(row["tokens"]) == 3 and all(len(t) == 6 for t in row["tokens"]), name
        assert row["generated_tokens"] == 18
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 0 and row["ttft_s_median"] > 0, name
        assert 0 < row["token_latency_ms_median"] <= row["token_latency_ms_p99"], name
        assert row["ttft_s_median"] < row["wall_s"], name
        cache = row["cache"]
        # sized for 3 x (40 + 6) tokens in blocks of 16
        assert (cache["block_size"], cache["num_blocks"], cache["max_batch_tokens"]) == (16, 9, 138), name
        assert row["cache_slots"] == (9 + 2) * 16
        # tiny Llama: 2 layers x (K + V) x 2 KV heads x 64 x 4 bytes per token
        assert row["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4 and row["kv_bytes"] == 2048 * row["cache_slots"]
    assert rows["dense"]["attention"] == "paged|sdpa" and rows["dense"]["signature_bytes"] == 0
    for name in METHODS[1:]:
        assert rows[name]["attention"] == "paged|hashattention"
        # 2 layers x 4 query heads x one 32-bit word per token
        assert rows[name]["signature_bytes_per_token"] == 2 * 4 * 4
        assert rows[name]["vs_dense"] == pytest.approx(rows[name]["tokens_per_s"] / rows["dense"]["tokens_per_s"])
    assert rows["hash-query_head-full"]["tokens_equal_dense"] is True
    assert rows["hash-query_head-full"]["tokens"] == rows["dense"]["tokens"]
    assert rows["hash-query_head-4"]["tokens_equal_dense"] is False  # the selection matters: the check can fail
    assert "tokens_equal_dense" not in rows["dense"]
    markdown = (tmp_path / "serving_cpu.md").read_text()
    assert markdown.count("| 40 | 3 |") == 3 and "paged\\|sdpa" in markdown
    assert record["meta"]["command"].startswith("python -m benchmarks.serving")

    record = run(tmp_path, "--prompt-tokens", "40", "--requests", "2", "--methods", "dense", "--merge", "--no-warmup")
    assert sorted((r["requests"], r["method"]) for r in record["rows"]) == sorted(
        [(3, m) for m in METHODS] + [(2, "dense")])
    md = tmp_path / "serving_cpu.md"
    md.unlink()
    bench.main(["--render", str(tmp_path / "serving_cpu.json")])
    assert md.read_text().count("| 40 |") == 4


def test_cache_sizing_and_overrides():
    args = bench.parse_args(["--prompt-tokens", "32768", "--requests", "4", "--new-tokens", "256"])
    assert bench.batching_settings(args, 32768, 4) == dict(block_size=256, num_blocks=4 * 129, max_batch_tokens=8192,
                                                           max_requests_per_batch=4)
    args = bench.parse_args(["--block-size", "64", "--num-blocks", "100", "--max-batch-tokens", "512"])
    assert bench.batching_settings(args, 1000, 2) == dict(block_size=64, num_blocks=100, max_batch_tokens=512,
                                                          max_requests_per_batch=2)
    args = bench.parse_args(["--cuda-graphs", "off"])
    assert bench.batching_settings(args, 100, 1)["use_cuda_graph"] is False


def test_quantile_matches_linear_interpolation():
    assert bench.quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert bench.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)
    assert bench.quantile([7.0], 0.99) == 7.0


@pytest.mark.parametrize("name, expected", [
    ("dense", {"dense": True}),
    ("hash-query_head-32", {"dense": False, "selection": "query_head", "sparsity": 32.0}),
    ("hash-kv_group-full", {"dense": False, "selection": "kv_group", "sparsity": None}),
])
def test_method_names(name, expected):
    assert bench.parse_method(name) == expected


@pytest.mark.parametrize("name, message", [
    ("hash-query_head-32@transformers", "no @ variants"),
    ("hash-group-32", "expected dense or hash-"),
    ("hash-query_head-x", "not a number"),
])
def test_bad_method_names(name, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_method(name)
