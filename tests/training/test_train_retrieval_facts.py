"""train/retrieval_facts.py: facts written early into a training sequence and restated in its query window."""

import pytest
import torch

from train.config import TrainConfig
from train.data import ByteTokenizer
from train.retrieval_facts import add_retrieval_facts


class DecodingByteTokenizer(ByteTokenizer):
    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def find_all(sequence, snippet):
    n = len(snippet)
    return [i for i in range(len(sequence) - n + 1) if sequence[i:i + n] == snippet]


PROSE = ("the harbor lights were burning over the meadow while quartz and amber glittered " * 40)[:2048]


def facts_on_prose(facts, index, style="repeat"):
    """``(config, tokenizer, sequence, out)``: ``facts`` facts of ``style`` written over 2048 tokens of prose."""
    tokenizer = DecodingByteTokenizer(256)
    config = TrainConfig(sequence_tokens=2048, queries_per_sequence=64, query_start_fraction=0.5,
                         retrieval_facts=facts, retrieval_fact_style=style, work_dir="unused")
    sequence = torch.tensor(tokenizer.encode(PROSE), dtype=torch.long)
    return config, tokenizer, sequence, add_retrieval_facts(config, tokenizer, sequence, index=index)


def test_each_fact_is_stated_before_the_query_window_and_restated_inside_it():
    config, tokenizer, sequence, out = facts_on_prose(4, index=3)
    assert out.shape == sequence.shape and out.dtype == sequence.dtype
    text = tokenizer.decode(out.tolist())
    statements = [s.strip() for s in text.split(" Note: ")[1:]]
    assert len(statements) == 8  # four facts, each twice
    first_query = config.first_query_position
    for fact in {s[: s.index(".") + 1] for s in statements}:
        ids = tokenizer.encode(" Note: " + fact)
        places = find_all(out.tolist(), ids)
        assert len(places) == 2, fact
        assert places[0] + len(ids) <= first_query <= places[1], (fact, places)
        assert fact.split(" vault is ")[0].split()[-1] in PROSE  # the word comes from the sequence's text
    changed = (out != sequence).nonzero().flatten()
    assert changed.numel() > 0 and changed.numel() <= 8 * 60  # only the written statements differ
    torch.testing.assert_close(add_retrieval_facts(config, tokenizer, sequence, index=3), out)  # seeded
    assert not torch.equal(add_retrieval_facts(config, tokenizer, sequence, index=4), out)


def test_no_facts_leaves_the_sequence_and_too_many_is_an_error():
    tokenizer = ByteTokenizer(256)  # no decode: words from a fallback list
    sequence = torch.arange(512) % 256
    plain = TrainConfig(sequence_tokens=512, queries_per_sequence=16, work_dir="unused")
    assert add_retrieval_facts(plain, tokenizer, sequence, 0) is sequence
    crowded = TrainConfig(sequence_tokens=512, queries_per_sequence=16, retrieval_facts=12, work_dir="unused")
    with pytest.raises(ValueError, match="retrieval_facts"):
        add_retrieval_facts(crowded, tokenizer, sequence, 0)
    with pytest.raises(ValueError, match="retrieval_facts"):
        TrainConfig(retrieval_facts=-1)


def test_paraphrase_style_restates_each_fact_in_other_words():
    from train.retrieval_facts import PARAPHRASES

    config, tokenizer, sequence, out = facts_on_prose(4, index=5, style="paraphrase")
    first_query = config.first_query_position
    before, inside = tokenizer.decode(out[:first_query].tolist()), tokenizer.decode(out[first_query:].tolist())
    found = 0
    for statement, paraphrase in PARAPHRASES:
        head, tail = statement.split("{w}")[0], paraphrase.split("{w}")[0]
        for start in [i for i in range(len(before)) if before.startswith(head, i)]:
            word = before[start + len(head):].split()[0]
            fact = statement.split("{d}")[0].format(w=word)
            assert before.startswith(fact, start), (fact, before[start:start + 80])
            digits = before[start + len(fact):].split(".")[0]
            assert digits.isdigit() and len(digits) == 7
            again = paraphrase.format(w=word, d=digits)
            assert again in inside, (again, inside[:200])  # restated in other words, same word and digits
            assert statement.format(w=word, d=digits) not in inside  # never word for word
            found += 1
        assert tail  # every paraphrase has a lead-in before the word
    assert found == 4
    torch.testing.assert_close(add_retrieval_facts(config, tokenizer, sequence, index=5), out)  # seeded


def test_repeat_style_is_the_default_and_a_bad_style_is_named():
    assert TrainConfig(sequence_tokens=512, queries_per_sequence=16, work_dir="unused").retrieval_fact_style == "repeat"
    with pytest.raises(ValueError, match="retrieval_fact_style"):
        TrainConfig(sequence_tokens=512, queries_per_sequence=16, retrieval_fact_style="echo", work_dir="unused")


def test_multivalue_style_states_two_codes_apart_and_restates_them_together():
    config, tokenizer, sequence, out = facts_on_prose(3, index=1, style="multivalue")
    tokens = out.tolist()
    first_query = config.first_query_position
    text = tokenizer.decode(tokens)
    restatements = [s.split(".")[0] for s in text.split(" Note: the access codes of the ")[1:]]
    assert len(restatements) == 3
    for restatement in restatements:  # "<word> vault are <d> and <e>"
        word, codes = restatement.split(" vault are ")
        first, second = codes.split(" and ")
        assert first != second and word in PROSE
        listed = find_all(tokens, tokenizer.encode(f" Note: the access codes of the {word} vault are {first} and {second}."))
        assert len(listed) == 1 and listed[0] >= first_query
        for code in (first, second):
            stated = find_all(tokens, tokenizer.encode(f" Note: the access code of the {word} vault is {code}."))
            assert len(stated) == 1 and stated[0] < first_query, (word, code)
    torch.testing.assert_close(add_retrieval_facts(config, tokenizer, sequence, index=1), out)  # seeded
    with pytest.raises(ValueError, match="retrieval_fact_style"):
        TrainConfig(retrieval_fact_style="multi")


def test_frequent_style_lists_words_with_zipf_counts_and_names_the_top_three_in_the_query_window():
    config, tokenizer, sequence, out = facts_on_prose(4, index=2, style="frequent")
    first_query = config.first_query_position
    before, inside = tokenizer.decode(out[:first_query].tolist()), tokenizer.decode(out[first_query:].tolist())
    # The facts as in "repeat": each stated once before the query window and once inside it.
    assert before.count(" Note: the access code of the ") == 4 and inside.count(" Note: the access code of the ") == 4
    # Three word lists before the window, none inside; word k of the four listed words occurs 12 // (k + 1) times.
    lists = [part.split(".")[0].split() for part in before.split(" Words: ")[1:]]
    assert len(lists) == 3 and " Words: " not in inside
    counts = {}
    for word in (w for words in lists for w in words):
        counts[word] = counts.get(word, 0) + 1
    assert sorted(counts.values(), reverse=True) == [12, 6, 4, 3]
    top = sorted(counts, key=counts.get, reverse=True)[:3]
    assert all(word in PROSE for word in counts)  # words of the sequence's own text
    assert f"are {top[0]}, {top[1]} and {top[2]}." in inside
    assert f"was {top[0]}, then {top[1]}, then {top[2]}." in inside
    assert f"lists, {top[0]} came up most, then {top[1]} and {top[2]}." in inside
    # The listed words are not the facts' words, and the whole thing is seeded.
    fact_words = {s.split(" vault")[0].split()[-1] for s in before.split(" Note: the access code of the ")[1:]}
    assert not fact_words & set(counts)
    torch.testing.assert_close(add_retrieval_facts(config, tokenizer, sequence, index=2), out)


def test_frequent_style_needs_three_words():
    """Its sentences name three words, so fewer than three is a config error that says so."""
    with pytest.raises(ValueError, match="retrieval_facts must be 0 or >= 3"):
        TrainConfig(retrieval_facts=2, retrieval_fact_style="frequent", work_dir="unused")
    config, tokenizer, sequence, out = facts_on_prose(3, index=0, style="frequent")
    assert tokenizer.decode(out.tolist()).count(" Words: ") == 3


def test_codes_style_writes_the_facts_and_a_code_stream_on_each_side_of_the_query_window():
    from train.retrieval_facts import CODE_VOCABULARY
    config, tokenizer, sequence, out = facts_on_prose(4, index=5, style="codes")
    first_query = config.first_query_position
    before, inside = tokenizer.decode(out[:first_query].tolist()), tokenizer.decode(out[first_query:].tolist())
    # The facts as in "repeat": each stated once before the query window and once inside it.
    assert before.count(" Note: the access code of the ") == 4 and inside.count(" Note: the access code of the ") == 4
    # One stream per side, a quarter of the query window long, of 3-7 letter codes from one vocabulary.
    stream_tokens = (config.sequence_tokens - first_query) // 4
    streams = []
    for side in (out[:first_query], out[first_query:]):
        places = find_all(side.tolist(), tokenizer.encode(" Codes:"))
        assert len(places) == 1
        streams.append(tokenizer.decode(side[places[0]:places[0] + stream_tokens].tolist()))
    codes = [stream.split(":", 1)[1].split()[:-1] for stream in streams]  # the last code may be cut
    assert all(3 <= len(c) <= 7 and c.isalpha() and c.islower() for side in codes for c in side)
    vocabulary = set(codes[0]) | set(codes[1])
    assert len(vocabulary) <= CODE_VOCABULARY and set(codes[1]) & set(codes[0])  # inside rows find earlier codes
    counts = sorted((sum(side.count(c) for side in codes) for c in vocabulary), reverse=True)
    assert counts[0] >= 3 * counts[len(counts) // 2]  # Zipf: a few codes dominate
    # Only the written snippets differ from the prose, and the whole thing is seeded.
    changed = (out != sequence).nonzero().flatten().numel()
    assert stream_tokens < changed <= 2 * stream_tokens + 8 * 60
    torch.testing.assert_close(add_retrieval_facts(config, tokenizer, sequence, index=5), out)
    assert not torch.equal(add_retrieval_facts(config, tokenizer, sequence, index=6), out)


def test_codes_style_that_does_not_fit_is_an_error_naming_retrieval_facts():
    tokenizer = DecodingByteTokenizer(256)
    sequence = torch.tensor(tokenizer.encode(PROSE[:512]), dtype=torch.long)
    crowded = TrainConfig(sequence_tokens=512, queries_per_sequence=16, retrieval_facts=8,
                          retrieval_fact_style="codes", work_dir="unused")
    with pytest.raises(ValueError, match="retrieval_facts: .* do not fit"):
        add_retrieval_facts(crowded, tokenizer, sequence, 0)
