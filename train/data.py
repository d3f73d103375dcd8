"""Training text: documents -> token sequences of a fixed length, with a fixed train/validation split.

Local corpus (the default, offline): every ``*.txt`` file under ``corpus`` (recursively). A document
belongs to the validation split iff ``crc32(relative path) % validation_modulus == 0`` (about 1 in 10
files with the default), so the split never depends on the number of files read or on their order.
Documents are read in a fixed pseudo-random order (by ``crc32(relative path)``, so one author or era
does not fill the first sequences), each is cut to its first ``document_tokens`` tokens (0 = whole;
a novel would otherwise fill dozens of sequences), and they are joined with the tokenizer's
end-of-sequence token (the paper joins OpenWebText passages) and cut into consecutive non-overlapping
sequences of ``sequence_tokens`` tokens; the tail that does not fill a sequence is dropped.

OpenWebText (``dataset = "openwebtext"``, needs network and the ``datasets`` package, imported lazily):
the streaming ``train`` split; document ``i`` is held out iff ``i % validation_modulus == 0``.
"""

from __future__ import annotations

import os
from typing import Iterator, List

import torch

from hashattention.corpus import corpus_files, is_held_out, path_checksum

from .config import TrainConfig


class ByteTokenizer:
    """UTF-8 bytes as token ids modulo the vocabulary (for tiny test models that ship no tokenizer)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]


def _local_documents(config: TrainConfig, split: str) -> Iterator[str]:
    for relative in sorted(corpus_files(config.corpus), key=lambda r: (path_checksum(r), r)):
        if is_held_out(relative, config.validation_modulus) == (split == "validation"):
            with open(os.path.join(config.corpus, relative), encoding="utf-8", errors="replace") as f:
                yield f.read()


def _openwebtext_documents(config: TrainConfig, split: str) -> Iterator[str]:
    import datasets  # lazy: optional, online only

    stream = datasets.load_dataset("Skylion007/openwebtext", split="train", streaming=True)
    for index, row in enumerate(stream):
        if (index % config.validation_modulus == 0) == (split == "validation"):
            yield "Passage: " + row["text"]


def token_sequences(config: TrainConfig, tokenizer, split: str, count: int) -> List[torch.Tensor]:
    """The first ``count`` int64 sequences ``(sequence_tokens,)`` of ``split`` ("train" / "validation").

    Raises a ValueError when the split holds fewer tokens than ``count`` sequences need.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if count == 0:
        return []
    documents = _openwebtext_documents if config.dataset == "openwebtext" else _local_documents
    separator = getattr(tokenizer, "eos_token_id", None)
    length = config.sequence_tokens
    buffer: List[int] = []
    sequences: List[torch.Tensor] = []
    for text in documents(config, split):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if config.document_tokens:
            ids = ids[: config.document_tokens]
        buffer.extend(int(i) for i in ids)
        if separator is not None:
            buffer.append(int(separator))
        while len(buffer) >= length and len(sequences) < count:
            sequences.append(torch.tensor(buffer[:length], dtype=torch.long))
            buffer = buffer[length:]
        if len(sequences) == count:
            return sequences
    raise ValueError(
        f"the {split} split of {config.dataset} corpus {config.corpus!r} holds only {len(sequences)} sequences "
        f"of {length} tokens, {count} requested (lower the count or the sequence length)"
    )
