"""scripts/ab_generate_summary.py on run folders written the way bench_generate.py writes them."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import ab_generate_summary  # noqa: E402


def write_run(folder, tag, ms_per_step, batch=4, status="ok"):
    os.makedirs(folder / tag)
    row = {"B": batch, "n": 131072, "method": "m", "status": status, "ms_per_step": ms_per_step,
           "tokens_per_s": batch * 1000.0 / ms_per_step}
    (folder / tag / "bench_generate_20261205.json").write_text(json.dumps({"rows": [row]}))


def test_medians_and_ratios_per_value(tmp_path):
    write_run(tmp_path, "dense", 20.0)
    for tag, ms in (("a1", 8.6), ("b1", 8.2), ("a2", 8.4), ("b2", 8.0), ("a3", 8.5), ("b3", 9.0)):
        write_run(tmp_path, tag, ms)
    write_run(tmp_path, "b4", 1.0, status="skipped: does not fit")  # not measured: left out
    text = ab_generate_summary.summarise(ab_generate_summary.load_rows(str(tmp_path)), "X", {"a": "0", "b": "2"})
    assert "| a1 | 0 | 8.600 | 465.1 | 2.326x |" in text
    assert "| b2 | 2 | 8.000 | 500.0 | 2.500x |" in text
    assert "- X=0: median 8.500 ms/step over 3 runs (min 8.400, max 8.600), 2.353x dense" in text
    assert "- X=2: median 8.200 ms/step over 3 runs (min 8.000, max 9.000), 2.439x dense" in text
    assert "b4" not in text
    lines = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "run" not in line]
    assert lines == ["| dense", "| a1", "| b1", "| a2", "| b2", "| a3", "| b3"]


def test_no_rows_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ab_generate_summary.py", str(tmp_path)])
    assert ab_generate_summary.main() == 1
    assert "no measured rows" in capsys.readouterr().err
