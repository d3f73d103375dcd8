"""benchmarks.decode_loop on the CPU: a tiny model end to end, the cache layouts it hands to FlashAttention,
its memory arithmetic, its results file (replaced by a run, merged with --merge) and its skip records (the
GPU numbers themselves come from GPU runs)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import decode_loop as bench
from benchmarks import decode_loop_dense as dense
from benchmarks import decode_loop_processes, decode_loop_report
from benchmarks import decode_loop_profile as profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = [sys.executable, "-m", "benchmarks.decode_loop"]
TINY = ["--tiny", "--device", "cpu", "--compile", "none", "--sink", "4", "--local", "4"]


def load_record(folder):
    names = [n for n in os.listdir(folder) if n.startswith("decode_loop_") and n.endswith(".json")]
    assert names == ["decode_loop_cpu.json"], names
    with open(os.path.join(folder, names[0])) as f:
        record = json.load(f)
    assert os.path.exists(os.path.join(folder, names[0][:-5] + ".md"))
    return record, os.path.join(folder, names[0][:-5] + ".md")


def test_cli_end_to_end_tiny_model(tmp_path):
    """Every (B, n, method) cell is measured; at a budget covering the cache HashAttention decodes dense's tokens."""
    methods = ["dense", "hash-query_head-full", "hash-kv_group-full", "hash-query_head-32"]
    command = [*COMMAND, *TINY, "--contexts", "96", "--batches", "1,2", "--steps", "4", "--profile-steps", "1",
               "--methods", ",".join(methods), "--out", str(tmp_path), "--trace-dir", str(tmp_path / "traces")]
    # A timing aid set for the run (it means nothing on the CPU) is recorded with the run.
    env = {**os.environ, "HASHATTENTION_ENCODER": "fma"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record, md_path = load_record(tmp_path)
    assert record["runs"][0]["environment"]["HASHATTENTION_ENCODER"] == "fma"
    rows = {(r["B"], r["n"], r["method"]): r for r in record["rows"]}
    assert set(rows) == {(b, 96, m) for b in (1, 2) for m in methods}
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row.get("reason"))
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, key
        assert row["ms_per_step"] > 0 and row["graph_breaks"] == 0
        assert row["cudnn_before_in_process"] is False  # the CPU checks run sdpa-math only
        assert math.isfinite(row["paced_ms_per_step"]) and row["paced_ms_per_step"] > 0, key
        tokens = torch.tensor(row["generated_tokens"])
        assert tokens.shape == (key[0], 4)
        assert 0 <= int(tokens.min()) and int(tokens.max()) < 512
    for batch in (1, 2):
        dense = rows[(batch, 96, "dense")]
        assert dense["dense_backend"] == "sdpa-math"
        for full in ("hash-query_head-full", "hash-kv_group-full"):
            assert rows[(batch, 96, full)]["generated_tokens"] == dense["generated_tokens"], (batch, full)
            assert rows[(batch, 96, full)]["first_divergence_from_dense"] == 4
        sparse = rows[(batch, 96, "hash-query_head-32")]
        assert sparse["ratio_to_dense"] > 0
        # 2 layers x 4 query-head signatures x 96 keys x 4 bytes per sequence; K+V 2 x 2 x 2 heads x 96 x 64 x 4 bytes
        assert sparse["signature_bytes"] == batch * 2 * 4 * 96 * 4
        assert dense["kv_bytes"] == batch * 2 * 2 * 2 * 96 * 64 * 4 and dense["signature_bytes"] == 0
        assert 0 < dense["attention_share"] and 0 < sparse["attention_share"]
        profile = sparse["profile"]
        assert profile["kernel_us_per_step"] > 0 and profile["category_us_per_step"]["selection"] > 0
        assert dense["profile"]["category_us_per_step"]["attention"] > 0
        assert profile["host_sync_calls_per_step"] == {}  # the CPU has no CUDA runtime calls to count
        assert profile["host_calls_us_per_step"] == {}
        for method in methods:  # each method's profiled steps as a Chrome trace, summarized (no GPU events here)
            assert os.path.getsize(tmp_path / "traces" / f"trace_B{batch}_n96_{method}.json.gz") > 0
            assert rows[(batch, 96, method)]["profile"]["timeline"]["gpu_events"] == 0
    fills = {(f["B"], f["n"]): f for f in record["fills"]}
    assert set(fills) == {(1, 96), (2, 96)}
    assert all(f["encode_s"]["query"] > 0 and f["encode_s"]["kv"] > 0 for f in fills.values())
    assert record["runs"][0]["command"].startswith("python -m benchmarks.decode_loop --tiny")
    # What ran in the process before each row: the cell's dense backend checks first, then the methods in order.
    assert rows[(1, 96, "dense")]["ran_before_in_process"] == ["dense checks B=1 n=96"]
    assert rows[(1, 96, "hash-kv_group-full")]["ran_before_in_process"] == [
        "dense checks B=1 n=96", "dense B=1 n=96", "hash-query_head-full B=1 n=96"]
    assert rows[(2, 96, "dense")]["ran_before_in_process"][-2:] == ["hash-query_head-32 B=1 n=96", "dense checks B=2 n=96"]
    assert len(rows[(2, 96, "hash-query_head-32")]["ran_before_in_process"]) == 9
    text = open(md_path).read()
    assert "| 2 | 96 | hash-query_head-32 |" in text and "target" not in text.lower()
    assert "; environment: `" in text and "HASHATTENTION_ENCODER=fma" in text
    assert "1 GPU job before it in its process" in text and "9 GPU jobs before it in its process" in text
    paced = rows[(2, 96, "dense")]["paced_ms_per_step"]
    assert f"{paced:.2f} ms a step alone" in text
    assert "| idle µs inside a replay |" in text  # no CUDA graphs on the CPU: "-" in that column


def test_prefill_fill_and_merge(tmp_path):
    """A real chunked prefill fills the cache; a run with --merge adds its rows to the file, one without
    replaces it."""
    common = [*TINY, "--contexts", "80", "--batches", "2", "--steps", "3", "--profile-steps", "0", "--out", str(tmp_path)]
    bench.main([*common, "--fill", "prefill", "--prefill-chunk", "32", "--methods", "dense,hash-kv_group-full"])
    record, _ = load_record(tmp_path)
    fill = record["fills"][0]
    assert fill["fill"] == "prefill" and fill["prefill_s"] > 0 and fill["prefill_attention_backend"] == "sdpa-math"
    rows = {r["method"]: r for r in record["rows"]}
    assert rows["hash-kv_group-full"]["generated_tokens"] == rows["dense"]["generated_tokens"]

    # dense comes from the first run (same fill, same seed: the same cache and first token)
    bench.main([*common, "--fill", "prefill", "--prefill-chunk", "32", "--methods", "hash-query_head-full",
                "--merge"])
    record, _ = load_record(tmp_path)
    rows = {r["method"]: r for r in record["rows"]}
    assert rows["hash-query_head-full"]["dense_from_earlier_run"] and rows["hash-query_head-full"]["ratio_to_dense"] > 0
    assert rows["hash-query_head-full"]["first_divergence_from_dense"] == 3  # same random tokens, same cache

    # one method per process in the other order: dense last still gives the earlier rows their ratio
    bench.main([*common, "--methods", "hash-query_head-32"])  # no --merge: the file starts over
    record, md_path = load_record(tmp_path)
    assert len(record["rows"]) == 1 and len(record["runs"]) == 1 and "ratio_to_dense" not in record["rows"][0]
    bench.main([*common, "--methods", "dense", "--merge"])
    record, md_path = load_record(tmp_path)
    rows = {r["method"]: r for r in record["rows"]}
    sparse = rows["hash-query_head-32"]
    assert sparse["dense_from_later_run"]
    assert sparse["ratio_to_dense"] == pytest.approx(sparse["tokens_per_s"] / rows["dense"]["tokens_per_s"])
    assert sparse["first_divergence_from_dense"] == first_divergence_reference(
        sparse["generated_tokens"], rows["dense"]["generated_tokens"])
    assert f"| 2 | 80 | hash-query_head-32 | {sparse['tokens_per_s']:.1f} | {sparse['ms_per_step']:.2f} | " \
           f"{sparse['ratio_to_dense']:.2f}x |" in open(md_path).read()

    bench.main([*common, "--methods", "hash-query_head-16", "--time-budget-s", "0", "--merge"])
    record, _ = load_record(tmp_path)
    methods = {r["method"]: r for r in record["rows"]}
    assert set(methods) == {"dense", "hash-query_head-32", "hash-query_head-16"}
    assert methods["hash-query_head-16"]["status"] == "skipped"
    assert "time budget" in methods["hash-query_head-16"]["reason"]
    assert len(record["runs"]) == 3

    # --render rewrites the table from the JSON alone, exactly as the run wrote it.
    written = open(md_path).read()
    os.remove(md_path)
    bench.main(["--render", str(tmp_path / os.path.basename(md_path).replace(".md", ".json"))])
    assert open(md_path).read() == written


def first_divergence_reference(tokens, reference):
    """Steps until the first step where any sequence's token differs (all steps if none)."""
    steps = len(tokens[0])
    return next((s for s in range(steps) if any(t[s] != r[s] for t, r in zip(tokens, reference))), steps)


def emulated_flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, used_k):
    """FlashAttention-2 varlen semantics in plain PyTorch: per sequence, the first used_k keys, GQA, bottom-right causal."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for s in range(cu_q.numel() - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].double()
        used = int(used_k[s])
        assert used <= max_k and cu_k[s] + used <= k.shape[0]
        ks = k[cu_k[s]:cu_k[s] + used].double().repeat_interleave(group, dim=1)
        vs = v[cu_k[s]:cu_k[s] + used].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,nhd->hln", qs, ks) * scale
        if causal:
            rows = qs.shape[0]
            visible = torch.arange(used)[None, :] <= (used - rows + torch.arange(rows))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out[cu_q[s]:cu_q[s + 1]] = torch.einsum("hln,nhd->lhd", scores.softmax(-1), vs).to(q.dtype)
    return out


@pytest.mark.parametrize("rows", [1, 5])
def test_flash_varlen_reads_the_static_cache_in_place(monkeypatch, rows):
    """The (sequence, KV head) packing of the HF cache and the output unpacking give exact GQA attention."""
    monkeypatch.setattr(dense, "FLASH_KERNEL", emulated_flash)
    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, slots, dim = 2, 8, 2, 40, 16
    key = torch.randn(batch, kv_heads, slots, dim, generator=g)
    value = torch.randn(batch, kv_heads, slots, dim, generator=g)
    query = torch.randn(batch, heads, rows, dim, generator=g)
    for lengths in ([31, 31], [23, 37]):
        got = dense.flash_varlen(query, key, value, torch.tensor(lengths, dtype=torch.int32), dim ** -0.5,
                                 causal=rows > 1)
        for b, valid in enumerate(lengths):
            want = dense.reference_attention(query[b:b + 1], key[b:b + 1], value[b:b + 1], valid, rows)
            torch.testing.assert_close(got[b:b + 1], want, atol=1e-5, rtol=1e-5)
    # dense_core takes the lengths from the decode rows' positions
    positions = torch.arange(31 - rows, 31)[None].expand(batch, rows)
    got = dense.dense_core("flash-varlen", query, key, value, None, positions, dim ** -0.5)
    torch.testing.assert_close(got, dense.reference_attention(query, key, value, 31, rows), atol=1e-5, rtol=1e-5)


def test_method_names_and_memory_arithmetic():
    method = bench.parse_method("hash-kv_group-16")
    assert (method.kind, method.selection, method.sparsity, method.family) == ("hash", "kv_group", 16.0, "kv")
    assert bench.parse_method("hash-query_head-full").full
    assert profile.kernel_category("void fast_histogram_kernel<4, 1>(SelectionParams, ...)") == "selection"
    assert profile.kernel_category("void sparse_attention_kernel<__nv_bfloat16, 128, 8>(AttentionParams)") == "attention"
    assert profile.kernel_category("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert profile.kernel_category("nvjet_hsh_128x64_64x4_1x2_h_bz_splitK_TNT") == "gemm"
    assert profile.kernel_category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "other"
    for encoder in ("fused_mlp_sign_kernel", "cluster_mlp_sign_kernel", "mma_mlp_sign_kernel"):
        assert profile.kernel_category(f"void hashattention::cuda::(anonymous namespace)::{encoder}(Launch)") == "encode"
    for bad in ("hash-query_head-1", "hash-rows-16", "sparse", "hash-kv_group-x"):
        with pytest.raises(ValueError, match="--methods"):
            bench.parse_method(bad)
    args = bench.parse_args(["--contexts", "131072", "--batches", "4", "--inductor-option", "none"])
    config = bench.model_config(args, 131072 + 200)
    need = bench.cell_bytes(config, 4, 131072, 2, ["kv", "query"], args)
    assert need["kv"] == 4 * 131072 * 32 * 4096          # 4 KiB of K+V per token and layer
    assert need["signatures"] == {"query": 4 * 131072 * 32 * 128, "kv": 4 * 131072 * 32 * 32}
    assert need["total"] > need["kv"] + sum(need["signatures"].values())
    frozen = bench.parse_args(["--contexts", "131072", "--batches", "4", "--inductor-option", "freezing=True"])
    concatenated = 32 * 4096 * (6144 + 2 * 14336) * 2  # q|k|v and gate|up weights, bf16, every layer
    assert bench.cell_bytes(config, 4, 131072, 2, ["kv", "query"], frozen)["total"] == need["total"] + concatenated
    assert config.rope_parameters["rope_type"] == "llama3" and config.max_position_embeddings >= 131072 + 200


def traceable_flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, used_k):
    """The same semantics for this script's packing only (equal rows and slots per sequence), without Python loops."""
    pairs = used_k.shape[0]
    rows, slots = max_q, max_k
    qs = q.reshape(pairs, rows, q.shape[1], q.shape[2])
    ks, vs = k.reshape(pairs, slots, k.shape[2]), v.reshape(pairs, slots, v.shape[2])
    scores = torch.einsum("prhd,psd->phrs", qs.float(), ks.float()) * scale
    last = used_k.long()[:, None] - rows + torch.arange(rows)[None, :]            # (pairs, rows) row positions
    visible = torch.arange(slots)[None, None, :] <= (last if causal else (used_k.long() - 1)[:, None].expand(-1, rows))[
        :, :, None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.einsum("phrs,psd->prhd", scores.softmax(-1), vs.float())
    return out.reshape(q.shape).to(q.dtype)


def test_decode_traces_as_one_graph(tmp_path, monkeypatch):
    """--compile eager: torch.compile(fullgraph=True) of the decode step (dense via the FlashAttention path, and
    HashAttention) records no graph break, and both decode the same tokens."""
    monkeypatch.setattr(dense, "FLASH_KERNEL", traceable_flash)
    monkeypatch.setattr(bench, "DENSE_CANDIDATES_CUDA", ("flash-varlen",))
    common = [*TINY, "--contexts", "64", "--batches", "2", "--steps", "3", "--profile-steps", "0",
              "--no-attention-share", "--methods", "dense,hash-query_head-full"]
    # On the CPU the script checks only sdpa-math; pin the dense backend to the FlashAttention path for this test.
    monkeypatch.setattr(bench, "check_dense_backends", lambda *a, **k: [{"backend": "flash-varlen", "ok": True}])
    traced = bench.main([*common, "--compile", "eager", "--out", str(tmp_path)])
    traced_rows = {r["method"]: r for r in traced["rows"]}
    for method in ("dense", "hash-query_head-full"):
        row = traced_rows[method]
        assert row["status"] == "ok", row.get("reason")
        assert row["graph_breaks"] == 0 and row["unique_graphs"] == 1, row
    assert traced_rows["dense"]["dense_backend"] == "flash-varlen"
    assert traced_rows["hash-query_head-full"]["generated_tokens"] == traced_rows["dense"]["generated_tokens"]


def test_process_per_method(tmp_path):
    """Each method in a child process of its own (after an untimed compile warm-up), rows merged into one file."""
    command = [*COMMAND, *TINY, "--compile", "eager", "--contexts", "64", "--batches", "1", "--steps", "3",
               "--profile-steps", "0", "--paced-steps", "0", "--methods", "hash-query_head-32,dense", "--out",
               str(tmp_path), "--process-per-method", "--warm-compile"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("compile-cache warm-up") == 2
    record, _ = load_record(tmp_path)
    assert len(record["runs"]) == 2  # the warm-up runs wrote elsewhere
    # one child per method, in the order given, each told its method last (argparse keeps the last --methods)
    assert [run["command"].split("--methods ")[-1].split()[0] for run in record["runs"]] == [
        "hash-query_head-32", "dense"]
    rows = {r["method"]: r for r in record["rows"]}
    assert set(rows) == {"hash-query_head-32", "dense"}
    sparse, dense_row = rows["hash-query_head-32"], rows["dense"]
    assert sparse["status"] == dense_row["status"] == "ok"
    assert sparse["ran_before_in_process"] == [] and not sparse["cudnn_before_in_process"]
    assert dense_row["ran_before_in_process"] == ["dense checks B=1 n=64"]
    assert sparse["dense_from_later_run"]  # its ratio came when the dense process merged its row
    assert sparse["ratio_to_dense"] == pytest.approx(sparse["tokens_per_s"] / dense_row["tokens_per_s"])


def test_process_per_method_arguments():
    argv = ["--tiny", "--merge", "--process-per-method", "--warm-compile", "--methods", "dense", "--out", "x"]
    assert decode_loop_processes.child_argv(argv) == ["--tiny", "--methods", "dense", "--out", "x"]
    with pytest.raises(SystemExit):  # only meaningful with --process-per-method
        bench.parse_args(["--warm-compile"])
    with pytest.raises(SystemExit):  # no abbreviations: the children get the options by their full names
        bench.parse_args(["--process-per"])


def test_dense_checks_stop_at_first_passing_backend():
    """The prefill's backend check stops at the first backend that passes, so later candidates (cuDNN) never run."""
    args = bench.parse_args(TINY)
    config = bench.model_config(args, 64)
    model = bench.build_model(config, torch.device("cpu"), torch.float32)
    cache = bench.new_static_cache(model, 1, 64, torch.device("cpu"), torch.float32)
    bench.fill_random(cache, 48, 0.5, 0)
    candidates = ("sdpa-math", "sdpa-efficient")
    every = dense.check_dense_backends(cache, config, 40, torch.device("cpu"), torch.float32, candidates, time_it=False)
    first = dense.check_dense_backends(cache, config, 40, torch.device("cpu"), torch.float32, candidates, time_it=False,
                                       first_passing=True)
    assert [c["backend"] for c in every] == list(candidates)
    assert [c["backend"] for c in first] == ["sdpa-math"] and first[0]["ok"]


def test_cudnn_use_is_tracked_and_reported(tmp_path):
    """A dense check through sdpa-cudnn marks the process, and the rows after it say so in the table."""
    import types

    state = types.SimpleNamespace(cudnn_used=False)
    bench.Benchmark.note_backends_run(state, [{"backend": "flash-varlen", "ok": True}])
    assert state.cudnn_used is False
    bench.Benchmark.note_backends_run(state, [{"backend": "sdpa-cudnn", "ok": False}])  # it ran, even if rejected
    assert state.cudnn_used is True
    bench.Benchmark.note_backends_run(state, [])
    assert state.cudnn_used is True  # the process stays marked

    bench.main([*TINY, "--contexts", "48", "--batches", "1", "--steps", "2", "--profile-steps", "0", "--paced-steps",
                "0", "--methods", "hash-query_head-full", "--out", str(tmp_path)])
    record, _ = load_record(tmp_path)
    assert "cuDNN used before it in its process" not in decode_loop_report.markdown(record)
    record["rows"][0]["cudnn_before_in_process"] = True
    assert "cuDNN used before it in its process" in decode_loop_report.markdown(record)


def test_host_time_in_cuda_api_calls_is_named_and_reported(tmp_path):
    """The profile keeps the CUDA runtime / driver calls' host time; the report lists them per row."""

    for name in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernelEx", "cudaStreamSynchronize"):
        assert profile.is_cuda_api_call(name), name
    for name in ("aten::mm", "cudnn_generated_fort_native_sdpa", "cuda_graph_replay", "custom_op", "Memcpy DtoD"):
        assert not profile.is_cuda_api_call(name), name
    bench.main([*TINY, "--contexts", "48", "--batches", "1", "--steps", "2", "--profile-steps", "1", "--paced-steps",
                "0", "--methods", "hash-query_head-32", "--out", str(tmp_path)])
    record, _ = load_record(tmp_path)
    row = record["rows"][0]
    assert row["profile"]["host_calls_us_per_step"] == {}  # no CUDA calls on the CPU
    assert "Host time per step in CUDA API calls" not in decode_loop_report.markdown(record)
    row["profile"]["host_calls_us_per_step"] = {"cudaGraphLaunch": {"host_us_per_step": 8374.6, "calls_per_step": 1.0}}
    text = decode_loop_report.markdown(record)
    assert "Host time per step in CUDA API calls" in text
    assert "- B = 1, 48, hash-query_head-32: cudaGraphLaunch 8375 (1)" in text


def test_inductor_pdl_is_set_recorded_and_compared_only_with_its_own_setting(tmp_path):
    """--inductor-pdl sets inductor's config for the run and is recorded per run and row; a row takes its ratio
    only from a dense row run with the same setting."""
    import torch._inductor.config as inductor_config

    common = [*TINY, "--contexts", "80", "--batches", "1", "--steps", "2", "--profile-steps", "0", "--out", str(tmp_path)]
    before = inductor_config.triton.enable_pdl
    try:
        bench.main([*common, "--methods", "dense", "--inductor-pdl", "off"])
        assert inductor_config.triton.enable_pdl is False
        bench.main([*common, "--methods", "hash-query_head-32", "--merge"])  # on by default
        assert inductor_config.triton.enable_pdl is True
        record, md_path = load_record(tmp_path)
        rows = {r["method"]: r for r in record["rows"]}
        assert rows["dense"]["inductor_pdl"] is False and rows["hash-query_head-32"]["inductor_pdl"] is True
        assert rows["hash-query_head-32"].get("ratio_to_dense") is None  # dense ran without PDL
        assert [run["inductor_pdl"] for run in record["runs"]] == [False, True]

        bench.main([*common, "--methods", "dense", "--merge"])  # the same setting as the sparse row: it now has a ratio
        record, md_path = load_record(tmp_path)
        rows = {r["method"]: r for r in record["rows"]}
        sparse = rows["hash-query_head-32"]
        assert rows["dense"]["inductor_pdl"] is True
        assert sparse["ratio_to_dense"] == pytest.approx(sparse["tokens_per_s"] / rows["dense"]["tokens_per_s"])
        text = open(md_path).read()
        assert text.count("compile: none, inductor PDL, ") == 2 and text.count("compile: none, ") == 3
    finally:
        inductor_config.triton.enable_pdl = before


def test_inductor_options_are_set_recorded_and_compared_only_with_the_same_options(tmp_path):
    """--inductor-option KEY=VALUE sets torch._inductor.config for the run, is recorded per run and row, and a row
    takes its ratio only from a dense row with the same options."""
    import torch._inductor.config as inductor_config

    common = [*TINY, "--contexts", "80", "--batches", "1", "--steps", "2", "--profile-steps", "0", "--out", str(tmp_path)]
    before = (inductor_config.combo_kernels, inductor_config.triton.max_tiles)
    try:
        bench.main([*common, "--methods", "dense"])
        bench.main([*common, "--methods", "hash-query_head-32", "--merge", "--inductor-option", "combo_kernels=True",
                    "--inductor-option", "triton.max_tiles=3"])
        assert inductor_config.combo_kernels is True and inductor_config.triton.max_tiles == 3
        record, md_path = load_record(tmp_path)
        rows = {r["method"]: r for r in record["rows"]}
        sparse = rows["hash-query_head-32"]
        assert rows["dense"]["inductor_options"] == {}
        assert sparse["inductor_options"] == {"combo_kernels": True, "triton.max_tiles": 3}
        assert sparse.get("ratio_to_dense") is None  # dense ran with inductor's defaults

        bench.main([*common, "--methods", "dense", "--merge", "--inductor-option", "combo_kernels=True",
                    "--inductor-option", "triton.max_tiles=3"])
        record, md_path = load_record(tmp_path)
        rows = {r["method"]: r for r in record["rows"]}
        sparse = rows["hash-query_head-32"]
        assert sparse["ratio_to_dense"] == pytest.approx(sparse["tokens_per_s"] / rows["dense"]["tokens_per_s"])
        assert [run["inductor_options"] for run in record["runs"]] == [{}, *2 * [{"combo_kernels": True,
                                                                                  "triton.max_tiles": 3}]]
        assert open(md_path).read().count("inductor combo_kernels=True, inductor triton.max_tiles=3") == 4
    finally:
        inductor_config.combo_kernels, inductor_config.triton.max_tiles = before


@pytest.mark.parametrize("option, message", [
    ("combo_kernels", "expected KEY=VALUE"),
    ("no_such_option=1", "has no option 'no_such_option'"),
    ("triton.no_such=1", "has no option 'triton.no_such'"),
    ("combo_kernels=yes", "must be a Python literal"),
    ("combo_kernels=3", "expected a bool"),
    ("triton.enable_pdl=False", "use --inductor-pdl"),
    ("post_grad_custom_pre_pass='no_such_pass'",
     "name one of this package's passes ('concat_projections', 'concat_projections_keep_layout')"),
    ("post_grad_custom_pre_pass='concat_projections_keep_layout'", "needs freezing=True"),
    ("post_grad_custom_pre_pass='concat_projections'", "needs freezing=True"),
])
def test_bad_inductor_options_are_refused_with_the_reason(option, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--inductor-option", option])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, layout", [("concat_projections", "row_major"),
                                          ("concat_projections_keep_layout", "keep")])
def test_a_named_graph_pass_is_recorded_by_name_and_installed_as_the_pass(name, layout):
    """post_grad_custom_pre_pass='concat_projections[_keep_layout]' (with freezing) is kept by name in the
    options that rows record and compare, and applying the options installs a ConcatProjections instance
    with the named layout."""
    import torch._inductor.config as inductor_config

    from hashattention.inductor_passes import ConcatProjections

    args = bench.parse_args([*TINY, "--inductor-option", "freezing=True", "--inductor-option",
                             f"post_grad_custom_pre_pass={name!r}"])
    assert args.inductor_options == {"freezing": True, "post_grad_custom_pre_pass": name}
    # inductor_config.patch, not monkeypatch: undoing a monkeypatch deletes the option from the config
    # module (it was never in the module's __dict__), which hides it from every later compile
    with inductor_config.patch(freezing=False, post_grad_custom_pre_pass=None):
        bench.apply_inductor_options(args.inductor_options)
        assert inductor_config.freezing is True
        assert isinstance(inductor_config.post_grad_custom_pre_pass, ConcatProjections)
        assert inductor_config.post_grad_custom_pre_pass.layout == layout
    assert inductor_config.freezing is False and inductor_config.post_grad_custom_pre_pass is None


def test_the_default_inductor_options_are_the_decode_steps_fastest_where_inductor_compiles():
    """Without --inductor-option, reduce-overhead runs get frozen weights with the merged projections (the GPU
    rows' settings); other compile modes get none; 'none' asks for inductor's own defaults."""
    compiled = [arg if arg != "none" else "reduce-overhead" for arg in TINY]
    assert bench.parse_args(compiled).inductor_options == {
        "freezing": True, "post_grad_custom_pre_pass": "concat_projections_keep_layout"}
    assert bench.parse_args([*TINY]).inductor_options == {}
    assert bench.parse_args([*compiled, "--inductor-option", "none"]).inductor_options == {}
    # The names stand for decode_compile_options()' settings.
    from hashattention.compile_options import decode_compile_options

    library = decode_compile_options()
    assert library["freezing"] is True
    assert library["post_grad_custom_pre_pass"].layout == bench.GRAPH_PASSES["concat_projections_keep_layout"]
