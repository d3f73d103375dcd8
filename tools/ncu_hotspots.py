"""Where a kernel's warps wait: the SASS instructions with the most stall samples in an Nsight Compute
source-page export, with their source lines.

    ncu --set full --import-source yes -k regex:resident_select -c 1 -o rep python -m tools.profile_ops ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m tools.ncu_hotspots sass.csv [--top 40]

Build with ``HASHATTENTION_LINEINFO=1`` so that instructions carry their source line. Prints the top
instructions by sampled warp stalls (all samples, and the not-issued ones when the export has them),
each instruction's share of the kernel's samples, and the same totals per source line (the
``Source`` cell of each row, when the export correlates it).
"""

from __future__ import annotations

import argparse
import csv
import sys


def find_column(header, *fragments):
    """The first column whose name contains every fragment (case-insensitive), or None."""
    for name in header:
        lowered = name.lower()
        if all(f.lower() in lowered for f in fragments):
            return name
    return None


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def top_reasons(row, reasons, count=2) -> str:
    """The instruction's largest stall reasons, e.g. "long_sb 120, mio 40"."""
    ranked = sorted(((number(row[name]), name[6:]) for name in reasons), reverse=True)[:count]
    return ", ".join(f"{name} {value:.0f}" for value, name in ranked if value > 0)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ncu_hotspots", description=__doc__.splitlines()[0])
    parser.add_argument("csv_file")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.csv_file, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # skip ncu's banner lines
    # Newer ncu versions put a "Kernel Name" line before the header: start at the header.
    start = next((i for i, line in enumerate(lines) if 'Address"' in line and '"Source"' in line), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print(f"{args.csv_file}: no CSV rows", file=sys.stderr)
        return 1
    header = list(rows[0].keys())
    samples = find_column(header, "stall sampling", "all") or find_column(header, "sampling")
    not_issued = find_column(header, "stall sampling", "not")
    source = find_column(header, "source")
    address = find_column(header, "address")
    executed = find_column(header, "instructions executed")
    if samples is None:
        print("no stall-sampling column; columns: " + ", ".join(header), file=sys.stderr)
        return 1
    total = sum(number(r[samples]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} stall samples ({samples})")
    # Per-reason totals (columns stall_<reason>, without the "(Not Issued)" copies), when exported.
    reasons = [name for name in header if name.startswith("stall_") and "(" not in name]
    if reasons:
        by_reason = {name: sum(number(r[name]) for r in rows) for name in reasons}
        print("by reason: " + ", ".join(f"{name[6:]} {100 * v / total:.1f}%"
                                         for name, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v > 0))
    print(f"{'share':>6} {'samples':>8} {'not-iss':>8} {'executed':>10}  address  instruction")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[: args.top]:
        print(f"{100 * number(r[samples]) / total:5.1f}% {number(r[samples]):8.0f} "
              f"{number(r[not_issued]) if not_issued else 0:8.0f} {number(r[executed]) if executed else 0:10.0f}  "
              f"{r.get(address, '') if address else '':>7}  {(r.get(source) or '').strip()[:70]:70}"
              + (f"  {top_reasons(r, reasons)}" if reasons else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
