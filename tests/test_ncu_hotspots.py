"""scripts/ncu_hotspots.py on a synthetic Nsight Compute source-page export (no GPU needed)."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "ncu_hotspots.py")

EXPORT = """==PROF== Connected to process 1
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"0x10","LDG.E.128 R4, [R2.64]","1,200","1,100","4096"
"0x20","POPC R5, R4","30","10","16384"
"0x30","ATOMS.POPC.INC.32 RZ, [R8]","770","700","16384"
"""


def run(tmp_path, text, *extra):
    path = tmp_path / "sass.csv"
    path.write_text(text)
    return subprocess.run([sys.executable, SCRIPT, str(path), *extra], capture_output=True, text=True)


def test_ranks_instructions_by_stall_samples_with_shares(tmp_path):
    result = run(tmp_path, EXPORT, "--top", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("3 instructions, 2000 stall samples")
    body = lines[2:]
    assert len(body) == 2
    assert "LDG.E.128" in body[0] and body[0].lstrip().startswith("60.0%")  # 1200 of 2000, thousands separator parsed
    assert "ATOMS" in body[1] and body[1].lstrip().startswith("38.5%")


def test_export_without_sampling_column_is_an_error(tmp_path):
    result = run(tmp_path, '"# Address","Source"\n"0x10","NOP"\n')
    assert result.returncode == 1
    assert "no stall-sampling column" in result.stderr
