"""Shared fixtures of the test suite (helpers that tests import live in tests/*_helpers.py).

Every op test runs on each available device: "cpu" always, "cuda" when a GPU is present
and the extension was built with CUDA kernels. Outputs are poisoned (NaN / 0xDEADBEEF) by
the kernels under HASHATTENTION_POISON_OUTPUTS=1, so an element a kernel forgets to write
fails the comparison instead of passing on zeroed memory.
"""

import os

os.environ["HASHATTENTION_POISON_OUTPUTS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist the workers already run side by side: one intra-op thread each. Torch's
# default (one per core in every worker) puts 14 workers x 16 threads on the GPU machine's 16
# cores, and the CPU-side references (float64 attention, Python-loop selection) then crawl.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from op_helpers import DEVICES  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
