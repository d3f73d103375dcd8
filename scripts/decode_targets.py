"""The decode benchmark's targets, checked against one run's rows, with what bounds each miss.

The targets (H200, B = 1, 32x, against the best dense SDPA row of the same run) are the CUDA
kernels issue's: per query head >= 4x at 32K, >= 5x at 128K and at 512K; group-shared >= 12x at
128K; score + select alone <= 6 µs at 128K. For each, ``evaluate`` takes the run's rows
(``scripts/bench_decode.py``'s records: dicts with ``batch``, ``n``, ``sparsity``, ``row``, ``us``,
``bytes``) and says whether it is met and, where it is not, what bounds it from the same run:

* the two launches apart (``select-*`` and ``attend-*`` rows) against their own read floors
  (``floor-read-select-*`` / ``floor-read-attend-*``: one kernel that only reads the same bytes);
* the one-launch read floor of the whole step (``floor-read-*``) and the ratio it would give;
* the cost of an empty launch in the same graph setting (``floor-empty``).

If the one-launch floor already exceeds the time a target needs, no kernel that reads those bytes
meets it on that GPU; if only the two launches' floors together exceed it, only one fused launch
could; otherwise the gap is the kernels' own latency, which the verdict splits per launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

TARGET_BATCH = 1
TARGET_SPARSITY = "32x"


@dataclass(frozen=True)
class Target:
    name: str
    mode: str  # "per-head" or "group": which rows of the run it reads
    n: int
    min_speedup: Optional[float] = None  # pipeline targets: ratio to the best dense row
    max_us: Optional[float] = None  # the selection target: an absolute time

    @property
    def row(self) -> str:
        return ("ours-" if self.min_speedup is not None else "select-") + self.mode


TARGETS: Tuple[Target, ...] = (
    Target("per query head, 32K", "per-head", 32768, min_speedup=4.0),
    Target("per query head, 128K", "per-head", 131072, min_speedup=5.0),
    Target("per query head, 512K", "per-head", 524288, min_speedup=5.0),
    Target("group-shared, 128K", "group", 131072, min_speedup=12.0),
    Target("score+select alone, 128K", "per-head", 131072, max_us=6.0),
)


def _index(results: Iterable[dict]) -> Dict[Tuple[int, str], dict]:
    """The B = 1 rows of the target sparsity (and the dense / empty-launch rows), by (n, row)."""
    rows = {}
    for r in results:
        if r["batch"] == TARGET_BATCH and r["sparsity"] in ("-", TARGET_SPARSITY):
            rows[(r["n"], r["row"])] = r
    return rows


def best_dense_us(rows: Dict[Tuple[int, str], dict], n: int) -> Optional[float]:
    times = [r["us"] for (rn, name), r in rows.items() if rn == n and name.startswith("sdpa")]
    return min(times) if times else None


def evaluate(results: Iterable[dict]) -> List[dict]:
    """One dict per target the run covers: measured, needed, met, floors and a one-line bound."""
    rows = _index(results)
    out = []
    for target in TARGETS:
        ours = rows.get((target.n, target.row))
        dense = best_dense_us(rows, target.n)
        if ours is None or (target.min_speedup is not None and dense is None):
            continue

        def us(name: str) -> Optional[float]:
            r = rows.get((target.n, name))
            return None if r is None else r["us"]

        entry = dict(target=target.name, n=target.n, row=target.row, us=ours["us"], dense_us=dense,
                     empty_us=us("floor-empty"))
        if target.min_speedup is not None:
            entry.update(goal=f">= {target.min_speedup:g}x", speedup=dense / ours["us"],
                         need_us=dense / target.min_speedup,
                         select_us=us("select-" + target.mode), attend_us=us("attend-" + target.mode),
                         floor_us=us("floor-read-" + target.mode),
                         floor_select_us=us("floor-read-select-" + target.mode),
                         floor_attend_us=us("floor-read-attend-" + target.mode))
            entry["measured"] = f"{entry['speedup']:.2f}x ({ours['us']:.1f} µs)"
        else:
            entry.update(goal=f"<= {target.max_us:g} µs", need_us=target.max_us,
                         floor_us=us("floor-read-select-" + target.mode))
            entry["measured"] = f"{ours['us']:.1f} µs"
        entry["met"] = ours["us"] <= entry["need_us"]
        entry["miss"] = ours["us"] / entry["need_us"]
        entry["bound"] = _bound(entry)
        out.append(entry)
    return out


def _bound(e: dict) -> str:
    if e["met"]:
        return "met"
    need, floor = e["need_us"], e.get("floor_us")
    text = f"needs <= {need:.1f} µs"
    empty = f"; an empty launch takes {e['empty_us']:.1f} µs" if e.get("empty_us") is not None else ""
    if "speedup" not in e:  # the selection alone
        if floor is None:
            return text + " (no read floor in this run)"
        if floor > need:
            return (text + f"; a kernel that only reads the same signature bytes takes {floor:.1f} µs{empty}: "
                    "below this GPU's floor for a kernel of its own")
        return text + f"; the bytes' read floor is {floor:.1f} µs{empty}: {e['us'] - floor:.1f} µs is the kernel's own latency"
    parts = []
    if e.get("select_us") is not None and e.get("attend_us") is not None:
        parts.append(f"selection {e['select_us']:.1f} µs + attention {e['attend_us']:.1f} µs, two launches")
    fs, fa = e.get("floor_select_us"), e.get("floor_attend_us")
    if fs is not None and fa is not None:
        parts.append(f"their read floors {fs:.1f} + {fa:.1f} µs")
    if floor is not None:
        parts.append(f"one launch reading every byte of the step {floor:.1f} µs ({e['dense_us'] / floor:.1f}x)")
    if parts:
        text += " (" + "; ".join(parts) + empty + ")"
    if floor is not None and floor > need:
        return text + ": below the read floor, no kernel that reads these bytes meets it on this GPU"
    if fs is not None and fa is not None and fs + fa > need:
        return text + ": two launches at their read floors would still miss; only one fused launch could"
    if fs is not None and fa is not None and e.get("select_us") is not None and e.get("attend_us") is not None:
        return (text + f": the bytes allow it; the selection is {e['select_us'] - fs:.1f} µs and the attention "
                f"{e['attend_us'] - fa:.1f} µs above their read floors")
    return text


def markdown(results: Iterable[dict]) -> List[str]:
    """The results file's targets section (empty when the run has no B = 1 / 32x rows)."""
    entries = evaluate(list(results))
    if not entries:
        return []
    lines = [f"## Targets (B = {TARGET_BATCH}, {TARGET_SPARSITY}) and what bounds each miss", "",
             "Floors measured in this run, timed like the rows above: `floor-empty` is a kernel that writes one "
             "word; `floor-read-*` one kernel that reads the same bytes contiguously once (the step's, the "
             "selection's or the attention's), no gathering and no second phase (`scripts/read_floor.py`).", "",
             "| target | goal | measured | met | needs µs | miss | what bounds it |", "|---|---|---|---|---|---|---|"]
    for e in entries:
        miss = "-" if e["met"] else f"{e['miss']:.2f}x over"
        lines.append(f"| {e['target']} | {e['goal']} | {e['measured']} | {'yes' if e['met'] else 'no'} | "
                     f"{e['need_us']:.1f} | {miss} | {e['bound']} |")
    return lines + [""]
