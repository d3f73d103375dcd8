"""Results of ``benchmarks.decode_loop``: the run's environment, the JSON record and its Markdown table.

The record holds one run's rows (or, with ``--merge``, those of several runs such as the processes of
``--process-per-method``): ``env`` (device, versions, code), ``runs`` (each process's command and
settings), ``rows`` (one per B, n and method), ``fills`` and ``dense_checks``.
"""

from __future__ import annotations

import json
from typing import List, Optional, Tuple

import torch

from benchmarks import common
from tools import provenance

BENCHMARK = "decode_loop"


def human_n(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def environment(device: torch.device) -> dict:
    """Device, library versions and code of this process, as the record's ``env``."""
    return {"device": common.device_name(device), **common.versions(), **provenance.describe()}


def cell_key(row) -> tuple:
    return (row["B"], row["n"], row["method"])


def results_paths(out: Optional[str], device: torch.device) -> Tuple[str, str]:
    """(Markdown, JSON) paths: ``<out>/decode_loop_<kind>`` of the device (default folder: benchmarks/results)."""
    return common.results_paths(BENCHMARK, common.device_kind(device), out)


def load_previous(path: str) -> dict:
    """The record in ``path``; {} if there is none or it does not parse."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_results(record: dict, json_path: str, md_path: str) -> None:
    common.write_results(md_path, json_path, markdown(record), record)


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def environment_note(run: dict) -> str:
    """"; environment: `A=1 B=2`" for a run that recorded set variables (runs before they were recorded: "")."""
    names = run.get("environment") or {}
    return "; environment: `" + " ".join(f"{k}={v}" for k, v in names.items()) + "`" if names else ""


def inductor_options_note(run: dict) -> str:
    """", inductor combo_kernels=True" for a run with --inductor-option settings ("" without)."""
    options = run.get("inductor_options") or {}
    return "".join(f", inductor {key}={value!r}" for key, value in options.items())


def markdown(record: dict) -> str:
    rows = sorted(record["rows"], key=lambda r: (r["B"], r["n"], r.get("order", 0)))
    lines = [
        "# End-to-end decode throughput: Llama-3.1-8B architecture, random bf16 weights",
        "",
        f"- date: {record['updated_utc']}; device: {record['env']['device']}; torch {record['env']['torch']}, "
        f"CUDA {record['env']['cuda']}, transformers {record['env']['transformers']}, {provenance.label(record['env'])}",
        "- commands (one line per process whose rows are in this file):",
        *[f"  - `{run['command']}` ({run['started_utc']}; fill: {run['fill']}, compile: {run['compile']}"
          f"{', inductor PDL' if run.get('inductor_pdl') else ''}{inductor_options_note(run)}, "
          f"{run['model']}{environment_note(run)})" for run in record["runs"]],
        "- tokens/s = B x steps / time of `steps` greedy decode steps (CUDA events, one sync at the end); ratio = "
        "tokens/s over dense's in the same (B, n); attention share = all layers' attention alone "
        "(CUDA-graph replay on the cell's cache) / ms per step; KV = K+V bytes of n tokens; signatures = the "
        "method's key-signature bytes of n tokens.",
        "",
        "| B | n | method | tokens/s | ms/step | ratio to dense | attention share | KV GB | signatures MB "
        "| compile s | graph breaks | cudagraph skips | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['B']} | {human_n(r['n'])} | {r['method']} | - | - | - | - | - | - | - | - | - | "
                         f"{r['status']}: {r.get('reason', '')[:160]} |")
            continue
        share = r.get("attention_share")
        notes = []
        if r.get("dense_backend"):
            notes.append(f"backend {r['dense_backend']}")
        if r.get("paced_ms_per_step"):
            notes.append(f"{r['paced_ms_per_step']:.2f} ms a step alone")
        if r.get("first_divergence_from_dense") is not None:
            notes.append(f"tokens = dense for {r['first_divergence_from_dense']} steps")
        if "ran_before_in_process" in r:
            before = len(r["ran_before_in_process"])
            notes.append("first GPU work of its process" if not before else
                         f"{before} GPU job{'s' if before > 1 else ''} before it in its process")
        if r.get("cudnn_before_in_process"):
            notes.append("cuDNN used before it in its process")
        if r.get("inductor_options"):
            notes.append(inductor_options_note(r)[2:])
        lines.append(
            f"| {r['B']} | {human_n(r['n'])} | {r['method']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
            f"{fmt(r.get('ratio_to_dense'), '.2f')}{'x' if r.get('ratio_to_dense') else ''} | "
            f"{fmt(None if share is None else 100 * share, '.0f')}{'%' if share is not None else ''} | "
            f"{r['kv_bytes'] / 1e9:.3g} | {r['signature_bytes'] / 1e6:.4g} | {fmt(r.get('compile_s'), '.1f')} | "
            f"{r.get('graph_breaks', '-')} | {r.get('cudagraph_skips', '-')} | {'; '.join(notes)} |")
    lines += ["", "## Cache fill per (B, n)", "",
              "| B | n | fill | fill s | prefill s | signature encode s (per-query-head keys) | (per-KV-head keys) |",
              "|---|---|---|---|---|---|---|"]
    for f in sorted(record["fills"], key=lambda f: (f["B"], f["n"])):
        enc = f.get("encode_s", {})
        lines.append(f"| {f['B']} | {human_n(f['n'])} | {f['fill']} | {fmt(f.get('fill_s'), '.2f')} | "
                     f"{fmt(f.get('prefill_s'), '.2f')} | {fmt(enc.get('query'), '.3f')} | {fmt(enc.get('kv'), '.3f')} |")
    profiled = [r for r in rows if r["status"] == "ok" and "category_us_per_step" in r.get("profile", {})]
    if profiled:
        lines += ["", "## Profile of extra decode steps (torch.profiler; kernel µs per step)", "",
                  "| B | n | method | all kernels | attention | selection | encode | gemm | other | host syncs per step "
                  "| kernels per graph replay | idle µs inside a replay |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in profiled:
            p, c = r["profile"], r["profile"]["category_us_per_step"]
            replays = (p.get("timeline") or {}).get("graph_replays") or {}  # with --trace-dir
            syncs = ", ".join(f"{k} {v:g}" for k, v in p["host_sync_calls_per_step"].items()) or "none"
            lines.append(f"| {r['B']} | {human_n(r['n'])} | {r['method']} | {p['kernel_us_per_step']:.0f} | "
                         + " | ".join(f"{c.get(k, 0.0):.0f}" for k in ("attention", "selection", "encode", "gemm", "other"))
                         + f" | {syncs} | {fmt(replays.get('kernels'), 'g')} | {fmt(replays.get('idle_inside_us'), '.0f')} |")
        host = [(r, calls) for r in profiled if (calls := r["profile"].get("host_calls_us_per_step"))]
        if host:
            lines += ["", "Host time per step in CUDA API calls (µs, calls per step; a call near the step time "
                      "blocked until the GPU caught up; the profiler's own cudaDeviceSynchronize at its end is "
                      "included).", ""]
            for r, calls in host:
                lines.append(f"- B = {r['B']}, {human_n(r['n'])}, {r['method']}: " + ", ".join(
                    f"{name} {c['host_us_per_step']:.0f} ({c['calls_per_step']:g})" for name, c in calls.items()))
    return "\n".join(lines)


def comparable_key(row: dict) -> tuple:
    """Rows with the same key ran the same cell setup, so their tokens/s and tokens compare."""
    # Rows from before --inductor-pdl ran without it; rows from before --inductor-option ran with none.
    options = tuple(sorted((k, repr(v)) for k, v in (row.get("inductor_options") or {}).items()))
    return row["B"], row["n"], row.get("fill"), row.get("steps"), row.get("inductor_pdl", False), options


def link_to_later_dense(rows: List[dict], dense: dict) -> None:
    """Give the rows of ``dense``'s cell that ran before it (an earlier process merged into the same record,
    one method per process) their ratio and token agreement with it, as a dense row run first would have."""
    for r in rows:
        if (r is dense or r["status"] != "ok" or r["method"] == "dense" or r.get("ratio_to_dense") is not None
                or comparable_key(r) != comparable_key(dense)):
            continue
        r["ratio_to_dense"] = r["tokens_per_s"] / dense["tokens_per_s"]
        r["first_divergence_from_dense"] = first_divergence(r["generated_tokens"], dense["generated_tokens"])
        r["dense_from_later_run"] = True


def first_divergence(tokens, reference) -> Optional[int]:
    """Number of leading steps where every sequence's token equals the reference's."""
    if reference is None or len(tokens) != len(reference):
        return None
    steps = len(tokens[0])
    for step in range(steps):
        if any(row[step] != ref[step] for row, ref in zip(tokens, reference)):
            return step
    return steps
