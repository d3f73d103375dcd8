"""tools.provenance: the source digest of a working tree equals that of the commit it came from."""

import os
import shutil
import subprocess

import pytest

from tools import provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def run_git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def make_repo(root):
    files = {"setup.py": "print('setup')\n", "csrc/op.cpp": "int f();\n", "csrc/cuda/k.cu": "__global__ void k();\n",
             "hashattention/__init__.py": "x = 1\n", "hashattention/data.json": "{}\n", "README.md": "text\n"}
    for relative, content in files.items():
        path = os.path.join(root, *relative.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)
    run_git(root, "init", "-q")
    run_git(root, "add", "-A")
    run_git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")


def test_digest_of_a_clean_tree_matches_its_commit(tmp_path):
    make_repo(str(tmp_path))
    info = provenance.describe(str(tmp_path))
    assert info["git_commit"] and info["git_dirty"] is False
    assert info["source_sha256"] == provenance.digest(provenance.commit_files("HEAD", str(tmp_path)))
    assert len(info["source_sha256"]) == 16
    assert "uncommitted" not in provenance.label(info)


def test_source_changes_are_detected_and_other_files_ignored(tmp_path):
    root = str(tmp_path)
    make_repo(root)
    clean = provenance.describe(root)["source_sha256"]
    for relative in ("README.md", "hashattention/data.json"):  # not sources: the digest stays
        with open(os.path.join(root, relative), "a") as f:
            f.write("more\n")
    os.makedirs(os.path.join(root, "hashattention", "__pycache__"))
    with open(os.path.join(root, "hashattention", "__pycache__", "x.py"), "w") as f:
        f.write("cached\n")
    assert provenance.describe(root)["source_sha256"] == clean
    with open(os.path.join(root, "csrc", "cuda", "k.cu"), "a") as f:
        f.write("// changed\n")
    changed = provenance.describe(root)
    assert changed["source_sha256"] != clean and changed["git_dirty"] is True
    assert "uncommitted changes" in provenance.label(changed)


def test_without_git_metadata(tmp_path):
    root = str(tmp_path)
    make_repo(root)
    shutil.rmtree(os.path.join(root, ".git"))
    info = provenance.describe(root)
    assert info["git_commit"] == "" and info["git_dirty"] is None and len(info["source_sha256"]) == 16
    with pytest.raises(ValueError, match="commit"):
        list(provenance.commit_files("HEAD", root))
