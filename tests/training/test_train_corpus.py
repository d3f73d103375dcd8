"""The corpus split shared by the adapter training and the evaluation (hashattention/corpus.py), and
where each finds its corpus."""

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


def test_the_training_defaults_to_the_shared_corpus_next_to_the_clone_else_the_sample(monkeypatch, tmp_path):
    train_config = pytest.importorskip("train.config")
    clone = tmp_path / "clone"
    monkeypatch.setattr(train_config, "REPO_ROOT", str(clone))
    monkeypatch.setattr(train_config, "SAMPLE_CORPUS", str(clone / "train" / "sample_corpus"))
    assert train_config.default_corpus() == str(clone / "train" / "sample_corpus")
    (tmp_path / "shared" / "corpus").mkdir(parents=True)
    assert train_config.default_corpus() == str(tmp_path / "shared" / "corpus")


def test_the_installed_evaluation_has_no_default_corpus(capsys):
    """The package never reaches into a checkout: the evaluation is told which corpus to read."""
    from hashattention.evaluation import cli

    with pytest.raises(SystemExit):
        cli.main(["--model", "some-model-dir"])
    assert "--corpus DIR is required" in capsys.readouterr().err
    assert not hasattr(corpus, "default_corpus")
