"""Retrieval-shaped training text: facts early in a sequence, restated where queries are sampled.

Prose rarely makes a query attend far back to one exact earlier phrase, which is what a retrieval
head does when a question names a fact stated thousands of tokens before (the evaluation's needle
tasks). Adapters fitted on prose alone keep half or less of that attention (docs/training.md).
With ``retrieval_facts = F`` each *training* sequence gets F facts of the form

    "Note: the access code of the <word> vault is <digits>."

written over its tokens at random places before the query window, and the same F statements
again, in another order, inside the query window ``[first_query_position, sequence_tokens)``. A
query row inside a restatement then has the earlier statement among its true top keys, so the
labels teach the signatures that match. With ``retrieval_fact_style = "paraphrase"`` each fact
takes one of several statement / paraphrase pairs instead (``PARAPHRASES``): the restatement names
the same word and digits in other words, as a question names a needle in words of its own, so the
query rows must find the earlier digits without a verbatim match. The templates differ from the
evaluation tasks' ("special magic number") on purpose, the words come from the training documents'
own text, and validation sequences are left as they are, so held-out recall stays comparable with
adapters fitted on prose. With ``retrieval_fact_style = "multivalue"`` each word gets two codes,
stated apart before the query window, and one restatement inside it lists both (the shape of a
needle with several values). With ``retrieval_fact_style = "frequent"`` the facts are written as
with ``"repeat"``, and the sequence also gets word lists before the query window: a second set of F
words drawn from the text, word k listed ``12 // (k + 1)`` times (12, 6, 4, 3, ...), shuffled and cut
into three lists; three sentences inside the query window name the three most frequent in order. A
query row there has the listed occurrences of its word among its true top keys, the shape of the
evaluation's frequent-word task (rows that must find every occurrence of a repeated word). With
``retrieval_fact_style = "codes"`` the facts are written as with ``"repeat"``, and each half also gets
a stream of made-up code words (3-7 random letters, a vocabulary of ``CODE_VOCABULARY`` words with
Zipf counts) a quarter of the query window long, both streams drawn from the same vocabulary. Text
of unfamiliar letter strings, where the next sub-word can only be found by looking at the earlier
occurrences of the same string, is what prose and the facts never show the induction-style heads
(the evaluation's word tasks and variable names are such text); the streams and facts are placed
in shuffled order with random gaps. Seeded by (seed, index): the same config writes the same
sequences.
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


# (statement, restatement in other words) pairs for retrieval_fact_style = "paraphrase".
PARAPHRASES = (
    (" Note: the access code of the {w} vault is {d}.", " To open the {w} vault, enter {d}."),
    (" Remember that the ticket number for {w} is {d}.", " Which ticket number was given for {w}? It was {d}."),
    (" The {w} account was opened with the PIN {d}.", " Logging in to the {w} account takes the PIN {d}."),
    (" For the record, the {w} file is stored under {d}.", " Look for the {w} file under {d}."),
    (" Our {w} locker uses the combination {d}.", " The combination of the {w} locker is {d}."),
    (" The parcel for {w} carries the tracking number {d}.", " Tracking the {w} parcel needs the number {d}."),
)


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
    digits = [str(rng.randrange(10**6, 10**7)) for _ in chosen]
    if config.retrieval_fact_style == "paraphrase":
        pairs = [rng.choice(PARAPHRASES) for _ in chosen]
        facts = [a.format(w=w, d=d) for (a, _), w, d in zip(pairs, chosen, digits)]
        restated = [b.format(w=w, d=d) for (_, b), w, d in zip(pairs, chosen, digits)]
    elif config.retrieval_fact_style == "multivalue":
        # Two codes per vault, stated apart; the restatement lists both, so the rows of each code
        # attend back to its own earlier statement (a multi-value needle's answer rows).
        others = [str(rng.randrange(10**6, 10**7)) for _ in chosen]
        facts = [_statement(w, d) for w, d in zip(chosen, digits)] + [_statement(w, e) for w, e in zip(chosen, others)]
        rng.shuffle(facts)
        restated = [f" Note: the access codes of the {w} vault are {d} and {e}." for w, d, e in zip(chosen, digits, others)]
    else:
        facts = restated = [_statement(w, d) for w, d in zip(chosen, digits)]
    if config.retrieval_fact_style == "codes":
        return _write_with_code_streams(config, tokenizer, sequence, facts, rng)
    if config.retrieval_fact_style == "frequent":
        rest = [w for w in words if w not in chosen]
        listed = rng.sample(rest, count) if len(rest) >= count else [rng.choice(words) + f"x{i}" for i in range(count)]
        lists, named = _frequent_word_lists(listed, rng)
        facts, restated = facts + lists, facts + named
    encoded = [tokenizer.encode(fact, add_special_tokens=False) for fact in facts]
    encoded_again = encoded if restated is facts else [tokenizer.encode(f, add_special_tokens=False) for f in restated]
    first_query = config.first_query_position
    out = sequence.clone()
    _write_spread(out, encoded, 1, first_query, rng, "before the query window")
    order = list(range(len(encoded_again)))
    rng.shuffle(order)
    _write_spread(out, [encoded_again[i] for i in order], first_query, config.sequence_tokens, rng,
                  "inside the query window")
    return out


def _frequent_word_lists(words: List[str], rng: random.Random):
    """``(lists, sentences)`` for retrieval_fact_style = "frequent": word k of ``words`` (at least three,
    which TrainConfig checks) appears ``12 // (k + 1)`` times over three shuffled lists, so the first three
    are strictly the most frequent (12 > 6 > 4 > 3); three sentences name them in order."""
    items = [w for k, w in enumerate(words) for _ in range(12 // (k + 1))]
    rng.shuffle(items)
    third = -(-len(items) // 3)
    lists = [" Words: " + " ".join(items[i:i + third]) + "." for i in range(0, len(items), third)]
    a, b, c = words[:3]
    sentences = [f" Note: the words listed most often above are {a}, {b} and {c}.",
                 f" The most frequent listed word was {a}, then {b}, then {c}.",
                 f" In the word lists, {a} came up most, then {b} and {c}."]
    return lists, sentences


CODE_VOCABULARY = 32


def _code_stream(tokenizer, vocabulary: List[str], weights: List[float], tokens: int,
                 rng: random.Random) -> List[int]:
    """Exactly ``tokens`` token ids of " Codes: c c c ..." with codes drawn from ``vocabulary`` by ``weights``."""
    ids = tokenizer.encode(" Codes:", add_special_tokens=False)
    while len(ids) < tokens:
        chunk = " " + " ".join(rng.choices(vocabulary, weights=weights, k=16))
        ids += tokenizer.encode(chunk, add_special_tokens=False)
    return ids[:tokens]


def _write_with_code_streams(config: TrainConfig, tokenizer, sequence: torch.Tensor, facts: List[str],
                             rng: random.Random) -> torch.Tensor:
    """retrieval_fact_style = "codes": the facts plus one code stream on each side of the query window."""
    first_query = config.first_query_position
    stream_tokens = max((config.sequence_tokens - first_query) // 4, 8)
    vocabulary: List[str] = []
    while len(vocabulary) < CODE_VOCABULARY:
        code = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7)))
        if code not in vocabulary:
            vocabulary.append(code)
    weights = [1.0 / (k + 1) for k in range(CODE_VOCABULARY)]
    encoded = [tokenizer.encode(fact, add_special_tokens=False) for fact in facts]
    out = sequence.clone()
    for start, end, where in ((1, first_query, "before the query window"),
                              (first_query, config.sequence_tokens, "inside the query window")):
        snippets = [list(ids) for ids in encoded] + [_code_stream(tokenizer, vocabulary, weights, stream_tokens, rng)]
        rng.shuffle(snippets)
        _write_with_random_gaps(out, snippets, start, end, rng, where)
    return out


def _write_with_random_gaps(out: torch.Tensor, snippets: List[List[int]], start: int, end: int,
                            rng: random.Random, where: str) -> None:
    """Writes the snippets over out[start:end] in order, separated by random gaps (snippets of unequal length)."""
    free = (end - start) - sum(len(ids) for ids in snippets) - len(snippets)
    if free < 0:
        raise ValueError(f"retrieval_facts: {len(snippets)} snippets of {sum(map(len, snippets))} tokens do not fit "
                         f"{where} ({end - start} tokens); lower retrieval_facts")
    cuts = sorted(rng.randint(0, free) for _ in snippets)
    at, previous = start, 0
    for cut, ids in zip(cuts, snippets):
        at += cut - previous + 1  # at least one token of the original text between snippets
        previous = cut
        out[at:at + len(ids)] = torch.tensor(ids, dtype=out.dtype)
        at += len(ids)


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
