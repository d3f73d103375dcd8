"""Checks that bad arguments to the CUDA kernels raise Python errors (each case in a subprocess, so a crash
shows as a return code instead of killing the check).

    python -m tools.cuda_error_probe
"""

import argparse
import subprocess
import sys

CASES = {
    "pack_signs bits": "ha.pack_signs(torch.randn(3, 500, device='cuda'))",
    "hamming_scores W": "ha.hamming_scores(torch.zeros(1,2,1,1,dtype=torch.int32,device='cuda'), "
    "torch.zeros(1,2,5,2,dtype=torch.int32,device='cuda'), 2)",
    "sparse_attention D": "ha.sparse_attention(torch.randn(1,2,1,96,device='cuda'), torch.randn(1,2,5,96,device='cuda'), "
    "torch.randn(1,2,5,96,device='cuda'), torch.zeros(1,2,1,3,dtype=torch.int32,device='cuda'), scale=1.0)",
    "cpu pack_signs bits": "ha.pack_signs(torch.randn(3, 500))",
}


def main(argv=None) -> None:
    argparse.ArgumentParser(prog="python -m tools.cuda_error_probe",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    for name, call in CASES.items():
        code = (f"import torch, hashattention as ha\ntry:\n    {call}\n    print('no error')\n"
                "except Exception as e:\n    print(type(e).__name__, str(e).splitlines()[0][:100])")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        crash = result.stderr.strip().splitlines()[-1:] if result.returncode else ""
        print(f"{name}: rc={result.returncode} {result.stdout.strip()} {crash}")


if __name__ == "__main__":
    main()
