"""tools.ncu_hotspots on a synthetic Nsight Compute source-page export (no GPU needed)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPORT = """==PROF== Connected to process 1
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"0x10","LDG.E.128 R4, [R2.64]","1,200","1,100","4096"
"0x20","POPC R5, R4","30","10","16384"
"0x30","ATOMS.POPC.INC.32 RZ, [R8]","770","700","16384"
"""


def run(tmp_path, text, *extra):
    path = tmp_path / "sass.csv"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "tools.ncu_hotspots", str(path), *extra], cwd=ROOT,
                          capture_output=True, text=True)


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


# ncu 2025+ exports start with the kernel's name and add one column per stall reason.
EXPORT_WITH_KERNEL_LINE = """"Kernel Name","void k<1>(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"
"0x10","LOP3.LUT R4, R2, UR4, RZ, 0x3c, !PT","90","100","80","10","70"
"0x20","BAR.SYNC 0x0","10","100","0","10","0"
"""


def test_kernel_name_line_is_skipped_and_stall_reasons_are_summed(tmp_path):
    result = run(tmp_path, EXPORT_WITH_KERNEL_LINE)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("2 instructions, 100 stall samples")
    assert lines[1] == "by reason: long_sb 80.0%, barrier 20.0%"  # the "(Not Issued)" copy is not counted
    assert "LOP3.LUT" in lines[3] and lines[3].rstrip().endswith("long_sb 80, barrier 10")
