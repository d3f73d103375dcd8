"""The corpus split shared by the adapter training and the evaluation (hashattention/corpus.py)."""

import os
import zlib

import pytest

from hashattention import corpus
from hashattention.evaluation import text

train_data = pytest.importorskip("train.data")


def write(root, relative, content="Some text."):
    path = os.path.join(root, *relative.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)


def test_files_are_sorted_slash_paths_without_readmes(tmp_path):
    for relative in ("b.txt", "a/z.txt", "a/README.txt", "a/notes.md", "c/d/e.txt"):
        write(tmp_path, relative)
    assert corpus.corpus_files(str(tmp_path)) == ["a/z.txt", "b.txt", "c/d/e.txt"]


def test_held_out_rule_is_crc32_of_the_slash_path():
    names = [f"dir{i % 3}/file{i}.txt" for i in range(200)]
    for modulus in (1, 3, 10):
        expected = [zlib.crc32(name.encode()) % modulus == 0 for name in names]
        assert [corpus.is_held_out(name, modulus) for name in names] == expected
    assert all(corpus.is_held_out(name, 1) for name in names)
    # about one file in ten with the default modulus
    assert 5 <= sum(corpus.is_held_out(name, 10) for name in names) <= 40


def test_training_and_evaluation_use_the_same_split(tmp_path):
    for i in range(40):
        write(tmp_path, f"part{i % 4}/doc{i}.txt", f"Document number {i}. " * 3)
    files = corpus.corpus_files(str(tmp_path))
    held_out = {f for f in files if corpus.is_held_out(f, 10)}
    assert held_out and len(held_out) < len(files)
    evaluation_texts = sorted(text.read_split(str(tmp_path), held_out=True, modulus=10))
    expected = sorted(open(os.path.join(tmp_path, f), encoding="utf-8").read() for f in held_out)
    assert evaluation_texts == expected
    # the training reads its validation documents through the same rule
    assert train_data.is_held_out is corpus.is_held_out and train_data.corpus_files is corpus.corpus_files


@pytest.mark.parametrize("bad", ["missing-dir", "empty-dir"])
def test_bad_corpus_raises(tmp_path, bad):
    path = tmp_path / bad
    if bad == "empty-dir":
        path.mkdir()
        write(path, "README.txt")
    with pytest.raises(ValueError, match="corpus"):
        corpus.corpus_files(str(path))
    with pytest.raises(ValueError, match="modulus"):
        corpus.is_held_out("a.txt", 0)


def test_a_missing_default_corpus_says_how_to_pass_one(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus, "REPO_ROOT", str(tmp_path / "site-packages"))
    monkeypatch.setattr(corpus, "SAMPLE_CORPUS", str(tmp_path / "site-packages" / "train" / "sample_corpus"))
    with pytest.raises(ValueError, match="--corpus DIR"):
        corpus.corpus_files(corpus.default_corpus())
