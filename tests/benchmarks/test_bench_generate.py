"""benchmarks.generate on the CPU: a tiny model through patch + model.generate end to end, its results file
and its method names (the GPU numbers come from GPU runs)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import generate as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--tiny", "--device", "cpu", "--sink", "4", "--local", "4", "--sparse-prompt-tokens", "8",
        "--new-tokens", "6", "--skip-tokens", "1", "--loop-steps", "2"]


def run(tmp_path, *arguments):
    command = [sys.executable, "-m", "benchmarks.generate", *TINY, *arguments, "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "generate_cpu.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_cli_end_to_end_tiny_model(tmp_path):
    """Every row is measured through generate; at a budget above every length HashAttention gives dense's tokens,
    and the patch's generation options do not change a sparse method's tokens."""
    methods = ["dense", "hash-query_head-full", "hash-kv_group-full", "hash-query_head-4",
               "hash-query_head-4@transformers"]
    record = run(tmp_path, "--contexts", "64", "--batches", "1,2", "--caches", "static,dynamic",
                 "--methods", ",".join(methods), "--recompile-check")
    rows = {(r["n"], r["B"], r["cache"], r["method"]): r for r in record["rows"]}
    assert set(rows) == {(64, b, c, m) for b in (1, 2) for c in ("static", "dynamic") for m in methods}
    for key, row in rows.items():
        assert "skipped" not in row, key
        assert row["decode_ms_per_token"] > 0 and row["ttft_s"] > 0 and row["tokens_per_s"] > 0, key
        assert len(row["tokens"]) == key[1] and all(len(t) == 6 for t in row["tokens"]), key
        assert row["recompiles"] == 0, key  # nothing is compiled on the CPU: a non-zero count is a bug
    for batch in (1, 2):
        for cache in ("static", "dynamic"):
            dense = rows[(64, batch, cache, "dense")]["tokens"]
            for full in ("hash-query_head-full", "hash-kv_group-full"):
                assert rows[(64, batch, cache, full)]["tokens"] == dense, (batch, cache, full)
            assert (rows[(64, batch, cache, "hash-query_head-4")]["tokens"]
                    == rows[(64, batch, cache, "hash-query_head-4@transformers")]["tokens"])
    markdown = (tmp_path / "generate_cpu.md").read_text()
    assert markdown.count("| 64 |") == len(rows)
    assert "hash-query_head-4@transformers" in markdown and record["meta"]["command"].startswith("python -m")


def test_merge_replaces_rows_of_the_same_key_and_render_rewrites_the_table(tmp_path):
    run(tmp_path, "--contexts", "48", "--batches", "1", "--caches", "dynamic", "--methods", "dense,hash-query_head-4")
    record = run(tmp_path, "--contexts", "48", "--batches", "1", "--caches", "dynamic", "--methods", "dense",
                 "--merge")
    assert sorted(r["method"] for r in record["rows"]) == ["dense", "hash-query_head-4"]
    md = tmp_path / "generate_cpu.md"
    md.unlink()
    bench.main(["--render", str(tmp_path / "generate_cpu.json")])
    assert "hash-query_head-4" in md.read_text()


@pytest.mark.parametrize("name, expected", [
    ("dense", {"dense": True}),
    ("hash-query_head-32", {"dense": False, "selection": "query_head", "sparsity": 32.0, "library_options": True}),
    ("hash-kv_group-full@transformers",
     {"dense": False, "selection": "kv_group", "sparsity": None, "library_options": False}),
])
def test_method_names(name, expected):
    assert bench.parse_method(name) == expected


@pytest.mark.parametrize("name, message", [
    ("dense@transformers", "no @transformers variant"),
    ("hash-query_head-32@fast", "the only variant"),
    ("hash-group-32", "expected dense or hash-"),
    ("hash-query_head-x", "not a number"),
])
def test_bad_method_names(name, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_method(name)
