"""Summarise an end-to-end A/B of scripts/ab_generate.sh: ms per step of every run, per value.

Reads <folder>/<tag>/bench_generate_*.json (tags dense, a1, b1, a2, b2, ...) and prints a Markdown
table: each run's ms per step and tokens/s, each value's median, and the ratio to dense's tokens/s.

    python scripts/ab_generate_summary.py /tmp/ab_generate --variable HASHATTENTION_ATTENTION_STAGES --a-value 0 --b-value 2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys


def load_rows(folder: str) -> dict[str, dict]:
    """The first measured row of each run folder, by tag."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(folder, "*", "bench_generate_*.json"))):
        tag = os.path.basename(os.path.dirname(path))
        with open(path) as f:
            measured = [r for r in json.load(f)["rows"] if r.get("status") == "ok"]
        if measured:
            rows[tag] = measured[0]
    return rows


def summarise(rows: dict[str, dict], variable: str, values: dict[str, str]) -> str:
    dense = rows.get("dense")
    lines = [f"| run | {variable} | ms/step | tokens/s | ratio to dense |", "|---|---|---|---|---|"]
    per_side: dict[str, list[float]] = {"a": [], "b": []}
    for tag in sorted(rows, key=lambda t: (t != "dense", int(t[1:]) if t[1:].isdigit() else 0, t)):
        row = rows[tag]
        ratio = f"{row['tokens_per_s'] / dense['tokens_per_s']:.3f}x" if dense and tag != "dense" else "-"
        value = values.get(tag[0], "?") if tag != "dense" else "-"
        lines.append(f"| {tag} | {value} | {row['ms_per_step']:.3f} | {row['tokens_per_s']:.1f} | {ratio} |")
        if tag[0] in per_side:  # "dense" starts with neither side's letter
            per_side[tag[0]].append(row["ms_per_step"])
    lines.append("")
    for side, times in per_side.items():
        if not times:
            continue
        median = statistics.median(times)
        ratio = f", {dense['ms_per_step'] / median:.3f}x dense" if dense else ""
        lines.append(f"- {variable}={values.get(side, '?')}: median {median:.3f} ms/step over {len(times)} runs"
                     f" (min {min(times):.3f}, max {max(times):.3f}){ratio}")
    if dense:
        lines.append(f"- dense: {dense['ms_per_step']:.3f} ms/step")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--variable", default="the setting")
    parser.add_argument("--a-value", default="?", help="the variable's value in runs a1, a2, ...")
    parser.add_argument("--b-value", default="?", help="the variable's value in runs b1, b2, ...")
    args = parser.parse_args()
    rows = load_rows(args.folder)
    if not rows:
        print(f"no measured rows under {args.folder}", file=sys.stderr)
        return 1
    values = {"a": args.a_value, "b": args.b_value}
    print(summarise(rows, args.variable, values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
