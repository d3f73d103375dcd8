"""Local text for the evaluation: corpus split, word pools and a byte tokenizer for tiny test models.

The corpus is a folder of ``*.txt`` files, always given explicitly (``--corpus``). Held-out files follow :mod:`hashattention.corpus`, the rule the adapter training validates with (same
default modulus, 10), so the evaluation text (NLL, RULER haystacks) was never seen by the trained
adapters. The other files provide calibration text (Double Sparsity) and word pools.
"""

from __future__ import annotations

import os
import re
from typing import List, Sequence

from ..corpus import corpus_files, is_held_out


def read_split(corpus: str, held_out: bool, modulus: int = 10) -> List[str]:
    """Texts of the held-out (``held_out=True``) or remaining files, in a fixed order."""
    texts = []
    for relative in corpus_files(corpus):
        if is_held_out(relative, modulus) == held_out:
            with open(os.path.join(corpus, relative), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    return texts


def sentences(texts: Sequence[str], min_chars: int = 20) -> List[str]:
    """Whitespace-normalised sentences (split after ``.``, ``!``, ``?``) of at least ``min_chars`` characters."""
    found = []
    for text in texts:
        flat = re.sub(r"\s+", " ", text)
        for sentence in re.split(r"(?<=[.!?])\s+", flat):
            if len(sentence) >= min_chars:
                found.append(sentence.strip())
    return found


def word_pool(texts: Sequence[str], min_length: int = 4, max_length: int = 10) -> List[str]:
    """Distinct lower-case alphabetic words of the texts, sorted (for needle keys and word lists)."""
    words = set()
    for text in texts:
        words.update(w.lower() for w in re.findall(r"[A-Za-z]+", text) if min_length <= len(w) <= max_length)
    return sorted(words)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, end of sequence 256 (for tiny test models without a tokenizer).

    Vocabulary size 257: a test model needs ``vocab_size >= 257``.
    """

    vocab_size = 257
    eos_token_id = 256
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
