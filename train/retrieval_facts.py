"""Retrieval-shaped training text: facts early in a sequence, restated where queries are sampled.

Prose rarely makes a query attend far back to one exact earlier phrase, which is what a retrieval
head does when a question names a fact stated thousands of tokens before (the evaluation's needle
tasks). Adapters fitted on prose alone keep half or less of that attention (README, Evaluation).
With ``retrieval_facts = F`` each *training* sequence gets F facts of the form

    "Note: the access code of the <word> vault is <digits>."

written over its tokens at random places before the query window, and the same F statements
again, in another order, inside the query window ``[first_query_position, sequence_tokens)``. A
query row inside a restatement then has the earlier statement among its true top keys, so the
labels teach the signatures that match. The template differs from the evaluation tasks' ("special
magic number") on purpose, the words come from the training documents' own text, and validation
sequences are left as they are, so held-out recall stays comparable with adapters fitted on prose.
Seeded by (seed, index): the same config writes the same sequences.
"""

from __future__ import annotations

import random
import re
from typing import List

import torch

from .config import TrainConfig

_WORD = re.compile(r"[A-Za-z]{4,12}")


def _statement(word: str, digits: str) -> str:
    return f" Note: the access code of the {word} vault is {digits}."


def add_retrieval_facts(config: TrainConfig, tokenizer, sequence: torch.Tensor, index: int) -> torch.Tensor:
    """A copy of the int64 ``(sequence_tokens,)`` training sequence ``index`` with
    ``config.retrieval_facts`` facts written over it (see the module docstring).

    Raises a ValueError when the facts do not fit: each half (before the query window, inside it)
    must hold every statement with room to spare.
    """
    count = config.retrieval_facts
    if count == 0:
        return sequence
    rng = random.Random(f"retrieval-facts:{config.seed}:{index}")
    text = tokenizer.decode(sequence.tolist()) if hasattr(tokenizer, "decode") else ""
    words = sorted({w.lower() for w in _WORD.findall(text)}) or ["amber", "cobalt", "harbor", "meadow", "quartz"]
    chosen = rng.sample(words, count) if len(words) >= count else [rng.choice(words) + str(i) for i in range(count)]
    facts = [_statement(word, str(rng.randrange(10**6, 10**7))) for word in chosen]
    encoded = [tokenizer.encode(fact, add_special_tokens=False) for fact in facts]
    first_query = config.first_query_position
    out = sequence.clone()
    _write_spread(out, encoded, 1, first_query, rng, "before the query window")
    order = list(range(count))
    rng.shuffle(order)
    _write_spread(out, [encoded[i] for i in order], first_query, config.sequence_tokens, rng, "inside the query window")
    return out


def _write_spread(out: torch.Tensor, snippets: List[List[int]], start: int, end: int, rng: random.Random,
                  where: str) -> None:
    """Writes the snippets over out[start:end] in order, each at a random place of its own equal slot."""
    slot = (end - start) // len(snippets)
    for k, ids in enumerate(snippets):
        if len(ids) >= slot:
            raise ValueError(f"retrieval_facts: {len(snippets)} facts of up to {max(map(len, snippets))} tokens do not "
                             f"fit {where} ({end - start} tokens); lower retrieval_facts")
        at = start + k * slot + rng.randrange(slot - len(ids))
        out[at:at + len(ids)] = torch.tensor(ids, dtype=out.dtype)
