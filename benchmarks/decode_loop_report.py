"""Results of scripts/bench_generate.py: the run's environment, the JSON record merged over runs of
a day, and its Markdown table with the issue's targets.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Dict, List, Optional

import torch

import provenance


TARGETS = ((1, 131072, "hash-query_head-32", 1.7), (4, 131072, "hash-query_head-32", 2.5))


def human_n(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def environment(args, device) -> dict:
    import transformers

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": platform.python_version(), **provenance.describe(),
    }


# Environment variables that change what a run measures: the package's timing aids (for example
# HASHATTENTION_ENCODER), inductor's settings and the CUDA runtime's. Each run records the ones set,
# so that its rows can be reproduced.
MEASURED_ENVIRONMENT_PREFIXES = ("HASHATTENTION_", "TORCHINDUCTOR_")


MEASURED_ENVIRONMENT_NAMES = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "CUDA_LAUNCH_BLOCKING",
                              "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING")


def measured_environment() -> Dict[str, str]:
    """The set variables of MEASURED_ENVIRONMENT_PREFIXES / _NAMES, by name."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(MEASURED_ENVIRONMENT_PREFIXES) or name in MEASURED_ENVIRONMENT_NAMES}


def cell_key(row) -> tuple:
    return (row["B"], row["n"], row["method"])


def results_json_path(out: str) -> str:
    """``<out>/bench_generate_<YYYYMMDD>.json`` for today (UTC); the Markdown file is beside it."""
    today = datetime.datetime.now(datetime.timezone.utc)
    return os.path.join(out, f"bench_generate_{today:%Y%m%d}.json")


def load_previous(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_results(record: dict, json_path: str, md_path: str) -> None:
    for path, text in ((json_path, json.dumps(record, indent=1)), (md_path, markdown(record))):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)


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
        f"- updated: {record['updated_utc']}; device: {record['env']['device']}; torch {record['env']['torch']}, "
        f"CUDA {record['env']['cuda']}, transformers {record['env']['transformers']}, {provenance.label(record['env'])}",
        "- commands (each run merges its rows into this file):",
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
    lines += ["", "## Targets (issue 7)", ""]
    lines += [target_line(record, *t) for t in TARGETS]
    return "\n".join(lines)


def comparable_key(row: dict) -> tuple:
    """Rows with the same key ran the same cell setup, so their tokens/s and tokens compare."""
    # Rows from before --inductor-pdl ran without it; rows from before --inductor-option ran with none.
    options = tuple(sorted((k, repr(v)) for k, v in (row.get("inductor_options") or {}).items()))
    return row["B"], row["n"], row.get("fill"), row.get("steps"), row.get("inductor_pdl", False), options


def link_to_later_dense(rows: List[dict], dense: dict) -> None:
    """Give the rows of ``dense``'s cell that ran before it (an earlier process of the day, one method per
    process) their ratio and token agreement with it, as a dense row run first would have."""
    for r in rows:
        if (r is dense or r["status"] != "ok" or r["method"] == "dense" or r.get("ratio_to_dense") is not None
                or comparable_key(r) != comparable_key(dense)):
            continue
        r["ratio_to_dense"] = r["tokens_per_s"] / dense["tokens_per_s"]
        r["first_divergence_from_dense"] = first_divergence(r["generated_tokens"], dense["generated_tokens"])
        r["dense_from_later_run"] = True


def target_line(record, batch, n, method, target) -> str:
    row = next((r for r in record["rows"] if (r["B"], r["n"], r["method"]) == (batch, n, method)), None)
    label = f"B = {batch}, {human_n(n)}, {method}: target >= {target}x tokens/s over dense"
    if row is None or row["status"] != "ok" or row.get("ratio_to_dense") is None:
        return f"- {label}: **not measured**" + (f" ({row['status']}: {row.get('reason', '')})" if row else "")
    ratio = row["ratio_to_dense"]
    if ratio >= target:
        return f"- {label}: **met**, {ratio:.2f}x ({ratio - target:+.2f}x)"
    return f"- {label}: **missed**, {ratio:.2f}x, short by {target - ratio:.2f}x ({100 * (1 - ratio / target):.0f}%)"


def first_divergence(tokens, reference) -> Optional[int]:
    """Number of leading steps where every sequence's token equals the reference's."""
    if reference is None or len(tokens) != len(reference):
        return None
    steps = len(tokens[0])
    for step in range(steps):
        if any(row[step] != ref[step] for row, ref in zip(tokens, reference)):
            return step
    return steps
