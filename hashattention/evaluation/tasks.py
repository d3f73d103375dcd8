"""RULER-style synthetic tasks (Hsieh et al., 2024), generated offline from local text.

Each task builds a prompt of at most ``context_tokens`` tokens (measured with the model's own
tokenizer and chat template, by bisection over the amount of filler) with known answers, and is
scored with RULER's ``string_match_all``: the share of reference strings found in the output.

Tasks (RULER's names in brackets):

* ``niah_single`` [niah_single]: one needle "One of the special magic numbers for KEY is: VALUE."
  in held-out prose; asked for KEY's number.
* ``niah_multikey`` [niah_multikey_1]: the target needle among three needles with other keys.
* ``niah_multivalue`` [niah_multivalue]: four needles with the same key; all four numbers asked.
* ``niah_multiquery`` [niah_multiquery]: four needles with different keys; all four asked.
* ``vt`` [vt]: a chain of variable assignments (VAR A = 12345, VAR B = VAR A, ...) hidden in
  repetitive noise; asked for every variable holding the value.
* ``cwe`` [cwe]: a numbered word list in which ten words repeat often and the rest three
  times; asked for the ten most common.
* ``fwe`` [fwe]: coded words drawn with Zipf frequencies (exponent 2); asked for the three
  most frequent.

Prompts go through the tokenizer's chat template (user turn) when it has one, followed by an
answer prefix that starts the assistant's reply, as RULER does.
"""

from __future__ import annotations

import dataclasses
import random
import string
from typing import Callable, List, Sequence, Tuple

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")

#: generated tokens per task (the answers are short; generation also stops once every reference appears)
MAX_NEW_TOKENS = {
    "niah_single": 24,
    "niah_multikey": 24,
    "niah_multivalue": 48,
    "niah_multiquery": 48,
    "vt": 32,
    "cwe": 64,
    "fwe": 32,
}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclasses.dataclass
class TaskSample:
    """One prompt with its answers. ``input_ids`` already include the chat template and answer prefix."""

    task: str
    index: int
    context_tokens: int
    input_ids: List[int]
    references: List[str]
    max_new_tokens: int


class PromptEncoder:
    """Prompt text + answer prefix -> token ids, through the chat template when the tokenizer has one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, prompt: str, answer_prefix: str) -> List[int]:
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer.encode(text + answer_prefix, add_special_tokens=False))
        return list(self.tokenizer.encode(prompt + "\n" + answer_prefix, add_special_tokens=False))


Builder = Callable[[int], Tuple[str, str, List[str]]]


def _fit(encoder: PromptEncoder, build: Builder, budget: int, most: int) -> Tuple[List[int], List[str]]:
    """The largest filler amount ``n`` in ``[0, most]`` whose prompt fits ``budget`` tokens (bisection)."""
    def encoded(n):
        prompt, prefix, references = build(n)
        return encoder.encode(prompt, prefix), references

    ids, references = encoded(0)
    if len(ids) > budget:
        raise ValueError(f"context_tokens ({budget}) is too small for this task: its bare prompt has {len(ids)} tokens")
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if len(encoded(middle)[0]) <= budget:
            low = middle
        else:
            high = middle - 1
    return encoded(low)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _distinct(rng: random.Random, pool: Sequence[str], count: int) -> List[str]:
    if len(pool) < count:
        raise ValueError(f"the word pool has {len(pool)} words, {count} needed")
    return rng.sample(list(pool), count)


def _insert(filler: List[str], items: Sequence[str], depths: Sequence[float]) -> str:
    """Insert ``items`` into the filler sentence list at relative ``depths`` in [0, 1]."""
    pieces = list(filler)
    for item, depth in sorted(zip(items, depths), key=lambda pair: pair[1], reverse=True):
        pieces.insert(round(depth * len(filler)), item)
    return " ".join(pieces)


def _haystack(sentences: Sequence[str], start: int, count: int) -> List[str]:
    return [sentences[(start + i) % len(sentences)] for i in range(count)]


def _niah(task: str, rng: random.Random, sentences: Sequence[str], words: Sequence[str], context_tokens: int) -> Tuple[Builder, int]:
    start = rng.randrange(len(sentences))
    keys = [f"{a}-{b}" for a, b in zip(_distinct(rng, words, 4), _distinct(rng, words, 4))]
    values = [_number(rng) for _ in range(4)]
    depths = [rng.random() for _ in range(4)]
    if task == "niah_single":
        needles, asked, references = [(keys[0], values[0])], [keys[0]], [values[0]]
    elif task == "niah_multikey":
        needles, asked, references = list(zip(keys, values)), [keys[0]], [values[0]]
    elif task == "niah_multivalue":
        needles, asked, references = [(keys[0], v) for v in values], [keys[0]], list(values)
    else:  # niah_multiquery
        needles, asked, references = list(zip(keys, values)), list(keys), list(values)
    needle_text = [f"One of the special magic numbers for {k} is: {v}." for k, v in needles]
    plural = len(references) > 1
    what = ", ".join(asked)
    question = (
        f"What are all the special magic numbers for {what} mentioned in the provided text?"
        if plural else f"What is the special magic number for {what} mentioned in the provided text?"
    )
    prefix = (
        f"The special magic numbers for {what} mentioned in the provided text are"
        if plural else f"The special magic number for {what} mentioned in the provided text is"
    )

    def build(n):
        text = _insert(_haystack(sentences, start, n), needle_text, depths[: len(needle_text)])
        prompt = (
            "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the numbers afterwards.\n{text}\n{question}"
        )
        return prompt, prefix, references

    return build, context_tokens // 4 + 1  # a sentence (>= 20 characters) has at least 4 tokens


def _variable_tracking(rng: random.Random, context_tokens: int) -> Tuple[Builder, int]:
    hops = 5
    names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(hops)]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops)]
    depths = sorted(rng.random() for _ in range(hops))

    def build(n):
        text = _insert([NOISE] * n, chain, depths)
        prompt = (
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            f"{text}\nQuestion: Find all variables that are assigned the value {value} in the text above."
        )
        prefix = (
            "Answer: According to the chain(s) of variable assignment in the text above, "
            f"{hops} variables are assigned the value {value}, they are:"
        )
        return prompt, prefix, list(names)

    return build, context_tokens // 8 + 1  # the noise paragraph has more than 8 tokens


def _common_words(rng: random.Random, words: Sequence[str], context_tokens: int) -> Tuple[Builder, int]:
    common_count, uncommon_frequency = 10, 3
    common_frequency = min(30, max(2, context_tokens // 256))  # 8 at 2K, 16 at 4K, 30 from 8K
    chosen = _distinct(rng, words, min(len(words), 4000))
    common, uncommon = chosen[:common_count], chosen[common_count:]
    order_seed = rng.random()

    def build(n):
        items = [w for w in common for _ in range(common_frequency)]
        items += [w for w in uncommon[:n] for _ in range(uncommon_frequency)]
        random.Random(order_seed).shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        prompt = (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            f"Memorize the ones that appear most often.\n{listing}\n"
            "Question: What are the 10 most common words in the above list?"
        )
        return prompt, "Answer: The top 10 words that appear most often in the list are:", list(common)

    return build, min(len(uncommon), context_tokens // 6 + 1)  # 3 entries of >= 2 tokens per word


def _frequent_words(rng: random.Random, context_tokens: int) -> Tuple[Builder, int]:
    vocabulary = ["".join(rng.choice(string.ascii_lowercase) for _ in range(5)) for _ in range(400)]
    vocabulary = list(dict.fromkeys(vocabulary))
    order_seed = rng.random()

    def build(n):
        top = n + 9  # Zipf counts n/(i+1)^2 keep the three most frequent strictly ahead from 9 on
        items = [w for i, w in enumerate(vocabulary) for _ in range(top // (i + 1) ** 2)]
        random.Random(order_seed).shuffle(items)
        prompt = (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. " + " ".join(items) + " ...\n"
            "Question: Do not provide any explanation. What are the three most frequently appeared words "
            "in the above coded text?"
        )
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        return prompt, prefix, vocabulary[:3]

    return build, context_tokens  # every coded word costs at least one token


def build_sample(task: str, index: int, context_tokens: int, seed: int, tokenizer,
                 sentences: Sequence[str], words: Sequence[str]) -> TaskSample:
    """Sample ``index`` of ``task`` at ``context_tokens`` (deterministic in all arguments)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not sentences or len(words) < 20:
        raise ValueError("the task generator needs haystack sentences and at least 20 distinct words")
    rng = random.Random(f"{seed}/{task}/{context_tokens}/{index}")
    if task.startswith("niah"):
        build, most = _niah(task, rng, sentences, words, context_tokens)
    elif task == "vt":
        build, most = _variable_tracking(rng, context_tokens)
    elif task == "cwe":
        build, most = _common_words(rng, words, context_tokens)
    else:
        build, most = _frequent_words(rng, context_tokens)
    ids, references = _fit(PromptEncoder(tokenizer), build, context_tokens, most)
    return TaskSample(task, index, context_tokens, ids, references, MAX_NEW_TOKENS[task])
