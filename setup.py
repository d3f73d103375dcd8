"""Build the hashattention extension (one shared library, ``hashattention._C``).

The C++ sources (schemas + CPU kernels) are always compiled. The CUDA sources in
``csrc/cuda/`` are compiled whenever torch is a CUDA build and nvcc is found --
deliberately *not* gated on ``torch.cuda.is_available()``, so that machines without
a GPU (CI, developers' laptops) still compile them and surface CUDA build errors.

Build variables (docs/building.md describes them and the run-time ones):
  HASHATTENTION_CPU_ONLY=1        skip the CUDA sources (quick iteration on C++ only)
  TORCH_CUDA_ARCH_LIST            GPU architectures to compile for; defaults to "9.0" (Hopper: H100/H200)
  HASHATTENTION_DEBUG=1           compile with -O0 -g (host) and -lineinfo (device)
  HASHATTENTION_LINEINFO=1        add -lineinfo to an optimised device build (Nsight Compute source view)
  HASHATTENTION_PTXAS_VERBOSE=1   print every kernel's registers and shared memory (-Xptxas=-v)
  HASHATTENTION_LIMITED_API=0     build a version-specific module instead of a CPython stable-ABI (abi3) one
  MAX_JOBS                        parallel compile jobs (ninja); defaults to the number of cores
A switch takes 1 / true / yes / on or 0 / false / no / off.
"""

import glob
import os
import platform
import shutil

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _locate_cuda_home():
    """Find the CUDA toolkit before torch guesses it.

    torch derives CUDA_HOME from the directory of `nvcc` on the PATH; where `nvcc` is a wrapper
    script (e.g. /usr/local/bin/nvcc exec-ing the real one) that guess is wrong and linking fails
    with "cannot find -lcudart". Accept only a directory that really holds a toolkit.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in candidates:
        if os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            os.environ["CUDA_HOME"] = home
            return


_locate_cuda_home()
from torch.utils import cpp_extension  # noqa: E402  (reads CUDA_HOME on import)


def _flag(name: str, default: bool = False) -> bool:
    """A build switch: unset or empty gives `default`; 1/true/yes/on and 0/false/no/off, else an error."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1, true, yes, on, 0, false, no or off, got {value!r}")


LIMITED_API = _flag("HASHATTENTION_LIMITED_API", default=True)


def _want_cuda() -> bool:
    if _flag("HASHATTENTION_CPU_ONLY"):
        return False
    import torch

    has_sources = bool(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    return has_sources and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _cuda_library_includes() -> list:
    """Include dirs for the CUDA library headers that torch's own headers pull in (cusparse.h, ...).

    A toolkit that ships only the compiler (as on the CI machine) lacks them; torch's CUDA
    wheels install them under site-packages/nvidia/*/include, so use those when needed.
    """
    home = cpp_extension.CUDA_HOME or ""
    if os.path.exists(os.path.join(home, "include", "cusparse.h")):
        return []
    try:
        import nvidia  # namespace package of the nvidia-* wheels torch depends on
    except ImportError:
        return []
    found = []
    for root in nvidia.__path__:
        for include in sorted(glob.glob(os.path.join(root, "*", "include"))):
            if os.path.exists(os.path.join(include, "cusparse.h")):
                found.append(include)
    return found[:1]


def _extension():
    debug = _flag("HASHATTENTION_DEBUG")
    with_cuda = _want_cuda()
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    cuda_sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))

    cxx = ["-O0", "-g"] if debug else ["-O3"]
    cxx += ["-fdiagnostics-color=always"]  # the C++ standard is left to torch (C++20 from 2.10)
    if platform.machine() in ("x86_64", "AMD64"):
        cxx.append("-mpopcnt")  # hardware popcount for the Hamming kernels
    define_macros = [("Py_LIMITED_API", "0x030A0000")] if LIMITED_API else []
    extra = {"cxx": cxx}

    include_dirs = [os.path.join(ROOT, "csrc")]
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        include_dirs += _cuda_library_includes()
        sources += cuda_sources
        define_macros.append(("HASHATTENTION_WITH_CUDA", "1"))
        nvcc = ["-O3", "--use_fast_math", "--expt-relaxed-constexpr"]
        # -lineinfo maps SASS to source lines for Nsight Compute's source page (tools/ncu_hotspots.py);
        # HASHATTENTION_LINEINFO adds it to an optimised build (HASHATTENTION_DEBUG also drops host -O3).
        nvcc += ["-lineinfo"] if debug or _flag("HASHATTENTION_LINEINFO") else []
        nvcc += ["-Xptxas=-v"] if _flag("HASHATTENTION_PTXAS_VERBOSE") else []
        extra["nvcc"] = nvcc
        ext_type = cpp_extension.CUDAExtension
    else:
        ext_type = cpp_extension.CppExtension

    return ext_type(
        name="hashattention._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args=extra,
        py_limited_api=LIMITED_API,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if LIMITED_API else {},
)
