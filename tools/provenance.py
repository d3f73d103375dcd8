"""Which code a benchmark ran: the git commit, whether the tree differed from it, and a digest of the sources.

A GPU machine may run on a copy of the working tree whose git metadata lags its files, so results
also record ``source_sha256``, a digest of the files that decide what runs and how it is measured:
``setup.py`` and the ``.py`` / ``.cpp`` / ``.h`` / ``.cu`` / ``.cuh`` files under ``csrc/``,
``hashattention/`` and ``benchmarks/``. The same digest of a commit tells which commit a result came
from:

    python -m tools.provenance                  # this working tree
    python -m tools.provenance --commit HEAD~3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
from typing import Dict, Iterable, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ("csrc", "hashattention", "benchmarks")
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh")
EXTRA_FILES = ("setup.py",)


def is_source(relative: str) -> bool:
    """Whether a repository-relative path (``/``-separated) is one of the digested sources."""
    if relative in EXTRA_FILES:
        return True
    parts = relative.split("/")
    return parts[0] in SOURCE_DIRS and "__pycache__" not in parts and relative.endswith(SOURCE_SUFFIXES)


def digest(files: Iterable[Tuple[str, bytes]]) -> str:
    """sha256 over (path, contents) pairs in path order; the first 16 hex digits."""
    h = hashlib.sha256()
    for relative, content in sorted(files):
        h.update(relative.encode() + b"\0" + hashlib.sha256(content).digest())
    return h.hexdigest()[:16]


def tree_files(root: str = REPO_ROOT):
    """(relative path, bytes) of every source file in the working tree at ``root``."""
    for top in SOURCE_DIRS + EXTRA_FILES:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            yield top, open(path, "rb").read()
            continue
        for directory, _, names in os.walk(path):
            for name in names:
                relative = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/")
                if is_source(relative):
                    with open(os.path.join(directory, name), "rb") as f:
                        yield relative, f.read()


def commit_files(commit: str, root: str = REPO_ROOT):
    """(relative path, bytes) of every source file of ``commit``; ValueError if it is not a commit."""
    listed = git(["ls-tree", "-r", "--name-only", commit, "--", *SOURCE_DIRS, *EXTRA_FILES], root)
    if listed is None:
        raise ValueError(f"commit {commit!r} is not a commit of the repository at {root}")
    for relative in listed.splitlines():
        if is_source(relative):
            yield relative, subprocess.run(["git", "show", f"{commit}:{relative}"], cwd=root, capture_output=True,
                                           check=True).stdout


def git(args, root: str) -> Optional[str]:
    try:
        result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return result.stdout if result.returncode == 0 else None


def describe(root: str = REPO_ROOT) -> Dict[str, object]:
    """``git_commit`` (short; "" without git), ``git_dirty`` (sources differ from it; None without git)
    and ``source_sha256`` of the working tree."""
    tree = digest(tree_files(root))
    commit = (git(["rev-parse", "--short", "HEAD"], root) or "").strip()
    dirty = None
    if commit:
        try:
            dirty = digest(commit_files(commit, root)) != tree
        except (ValueError, subprocess.CalledProcessError):
            dirty = None
    return {"git_commit": commit, "git_dirty": dirty, "source_sha256": tree}


def label(info: Dict[str, object]) -> str:
    """One line for a results file: ``commit <short hash>, sources <digest>``, with ``+ uncommitted changes``
    when the sources differ from the commit."""
    commit = info.get("git_commit") or "unknown"
    changed = " + uncommitted changes" if info.get("git_dirty") else ""
    return f"commit {commit}{changed}, sources {info.get('source_sha256')}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.provenance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", help="digest the sources of this commit instead of the working tree")
    args = parser.parse_args(argv)
    if args.commit:
        print(digest(commit_files(args.commit)))
    else:
        info = describe()
        print(info["source_sha256"], label(info))


if __name__ == "__main__":
    main()
