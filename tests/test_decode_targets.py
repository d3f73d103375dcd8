"""scripts/decode_targets.py: the decode benchmark's targets checked against rows of a run."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import decode_targets  # noqa: E402

K128 = 131072


def row(name, us, n=K128, batch=1, sparsity="32x"):
    return dict(batch=batch, n=n, sparsity=sparsity, row=name, us=us, bytes=0)


def step_rows(n=K128, dense=(130.0, 150.0), ours=38.0, select=13.0, attend=26.0, floor=(21.0, 6.4, 17.0),
              mode="per-head", empty=2.2):
    rows = [row("sdpa-cudnn", dense[0], n, sparsity="-"), row("sdpa-flash", dense[1], n, sparsity="-"),
            row("ours-" + mode, ours, n), row("select-" + mode, select, n), row("attend-" + mode, attend, n),
            row("floor-read-" + mode, floor[0], n), row("floor-read-select-" + mode, floor[1], n),
            row("floor-read-attend-" + mode, floor[2], n)]
    return rows + ([row("floor-empty", empty, n, sparsity="-")] if empty is not None else [])


def by_target(results):
    return {e["target"]: e for e in decode_targets.evaluate(results)}


def test_missed_target_whose_bytes_allow_it_names_each_launchs_excess():
    e = by_target(step_rows())["per query head, 128K"]
    assert not e["met"]
    assert e["dense_us"] == 130.0  # the best dense row, not the first
    assert e["speedup"] == pytest.approx(130.0 / 38.0)
    assert e["need_us"] == pytest.approx(26.0)
    assert e["miss"] == pytest.approx(38.0 / 26.0)
    assert "the bytes allow it" in e["bound"]
    assert "selection is 6.6 µs and the attention 9.0 µs above their read floors" in e["bound"]
    assert "an empty launch takes 2.2 µs" in e["bound"]


def test_only_a_fused_launch_when_the_two_floors_together_exceed_the_need():
    # need = 130 / 5 = 26 µs; one launch reads it all in 21, but 10 + 17 = 27 > 26.
    e = by_target(step_rows(floor=(21.0, 10.0, 17.0)))["per query head, 128K"]
    assert e["bound"].endswith("only one fused launch could")


def test_target_below_the_one_launch_floor_is_called_unreachable():
    e = by_target(step_rows(floor=(27.0, 10.0, 17.0)))["per query head, 128K"]
    assert e["bound"].endswith("no kernel that reads these bytes meets it on this GPU")
    assert "(4.8x)" in e["bound"]  # 130 / 27: the ratio at the floor


def test_met_target_and_group_rows():
    results = step_rows(dense=(130.0, 140.0), ours=10.0, mode="group")
    e = by_target(results)["group-shared, 128K"]
    assert e["met"] and e["bound"] == "met" and e["goal"] == ">= 12x"
    assert "per query head, 128K" not in by_target(results)  # no per-head rows in this run


def test_selection_target_against_its_read_floor():
    below = by_target(step_rows(select=13.0, floor=(21.0, 6.4, 17.0)))["score+select alone, 128K"]
    assert not below["met"] and below["need_us"] == 6.0
    assert "takes 6.4 µs" in below["bound"] and "below this GPU's floor" in below["bound"]
    reachable = by_target(step_rows(select=13.0, floor=(21.0, 4.0, 17.0)))["score+select alone, 128K"]
    assert "9.0 µs is the kernel's own latency" in reachable["bound"]
    met = by_target(step_rows(select=5.5))["score+select alone, 128K"]
    assert met["met"] and met["measured"] == "5.5 µs"


def test_other_batches_and_sparsities_are_ignored():
    rows = [dict(r, batch=8) for r in step_rows()] + [dict(r, sparsity="16x") for r in step_rows()
                                                      if r["sparsity"] != "-"]
    assert decode_targets.evaluate(rows) == []
    assert decode_targets.markdown(rows) == []


def test_rows_without_floors_still_give_the_miss():
    rows = [r for r in step_rows(empty=None) if not r["row"].startswith("floor")]
    e = by_target(rows)["per query head, 128K"]
    assert not e["met"] and e["miss"] == pytest.approx(38.0 / 26.0)
    assert e["bound"] == "needs <= 26.0 µs (selection 13.0 µs + attention 26.0 µs, two launches)"


def test_markdown_has_a_line_per_target_covered():
    results = step_rows() + step_rows(n=32768, dense=(38.7, 48.0), ours=20.5, select=7.9, attend=12.2,
                                      floor=(7.0, 3.5, 5.0))
    text = "\n".join(decode_targets.markdown(results))
    assert "| per query head, 32K | >= 4x | 1.89x (20.5 µs) | no | 9.7 | 2.12x over |" in text
    assert "| per query head, 128K | >= 5x | 3.42x (38.0 µs) | no | 26.0 | 1.46x over |" in text
    assert "| score+select alone, 128K | <= 6 µs | 13.0 µs | no | 6.0 | 2.17x over |" in text
    assert "512K" not in text
