"""Each selector of the evaluation harness against a brute-force reference on tiny inputs."""

import itertools
import math

import pytest
import torch

from evaluation_helpers import brute_force_select, selected_sets, tiny_shape
from hashattention.adapters import HashAdapters
from hashattention.evaluation.selectors import (
    Budget, SelectorSetup, SelectorUnavailable, create_selector, selector_names,
)

SHAPE = tiny_shape()
SCALING = 64**-0.5
BUDGET = Budget(sink_tokens=2, local_tokens=3, heavy_tokens=6)
KEYS, ROWS = 40, 3


def inputs(seed=0, batch=2, keys=KEYS, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, SHAPE.num_query_heads, rows, SHAPE.head_dim, generator=g)
    key = torch.randn(batch, SHAPE.num_kv_heads, keys, SHAPE.head_dim, generator=g)
    value = torch.randn(batch, SHAPE.num_kv_heads, keys, SHAPE.head_dim, generator=g)
    return query, key, value


def calibration(seed=5):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.1, 3.0, SHAPE.head_dim)  # distinct channel magnitudes: a clear ranking
    return {
        layer: (torch.randn(1, 4, 50, 64, generator=g) * scale, torch.randn(1, 2, 50, 64, generator=g) * scale.flip(0))
        for layer in range(SHAPE.num_layers)
    }


def prepared(name, **setup):
    selector = create_selector(name)
    selector.prepare(SelectorSetup(shape=SHAPE, calibration=setup.pop("calibration", calibration()), **setup))
    selector.start_sequence()
    return selector


def kv_of(head):
    return head // SHAPE.group_size


def check(selector, expected_scores, query, key, value):
    indices, counts = selector.select(0, query, key, value, BUDGET, SCALING)
    expected = brute_force_select(expected_scores, BUDGET.sink_tokens, BUDGET.local_tokens, BUDGET.heavy_tokens)
    assert selected_sets(indices, counts) == expected


def test_registry_lists_every_selector_of_the_paper():
    names = selector_names()
    assert names[:2] == ["full", "oracle"]
    for name in ("streaming", "h2o", "h2o-heavy-only", "quest", "double_sparsity-r2", "double_sparsity-r8", "lsh-32", "lsh-256",
                 "lsh-512", "lsh-1024", "hashattention", "hashattention-group"):
        assert name in names
    assert names.index("lsh-32") < names.index("lsh-256") < names.index("lsh-1024")
    with pytest.raises(ValueError, match="unknown selector 'nope'"):
        create_selector("nope")


def test_budget_for_sparsity():
    assert Budget.for_sparsity(2048, 16, 8, 8) == Budget(8, 8, 112)
    assert Budget.for_sparsity(100, 32, 8, 8) == Budget(8, 8, 0)  # windows alone exceed n/s: no heavy tokens
    with pytest.raises(ValueError, match="sparsity must be >= 1"):
        Budget.for_sparsity(100, 0.5, 8, 8)
    with pytest.raises(ValueError, match="Budget.heavy_tokens"):
        Budget(1, 1, -1)


def test_full_selects_every_causal_position():
    query, key, value = inputs()
    indices, counts = prepared("full").select(0, query, key, value, BUDGET, SCALING)
    for (b, s, l), chosen in selected_sets(indices, counts).items():
        assert chosen == set(range(KEYS - ROWS + l + 1))


def test_oracle_matches_brute_force():
    query, key, value = inputs(1)
    scores = torch.zeros(2, 4, ROWS, KEYS, dtype=torch.float64)
    for b, h, l, j in itertools.product(range(2), range(4), range(ROWS), range(KEYS)):
        scores[b, h, l, j] = float((query[b, h, l].double() * key[b, kv_of(h), j].double()).sum()) * SCALING
    check(prepared("oracle"), scores, query, key, value)


def test_streaming_keeps_sink_and_latest():
    query, key, value = inputs(2)
    indices, counts = prepared("streaming").select(0, query, key, value, BUDGET, SCALING)
    window = BUDGET.local_tokens + BUDGET.heavy_tokens
    for (b, s, l), chosen in selected_sets(indices, counts).items():
        p = KEYS - ROWS + l
        assert chosen == set(range(BUDGET.sink_tokens)) | set(range(p - window + 1, p + 1))


def test_quest_matches_brute_force_page_bounds():
    query, key, value = inputs(3, keys=37)  # a partial last page
    selector = create_selector("quest")
    selector.prepare(SelectorSetup(shape=SHAPE))
    page = selector.page_size
    scores = torch.zeros(2, 4, ROWS, 37, dtype=torch.float64)
    for b, h in itertools.product(range(2), range(4)):
        k = key[b, kv_of(h)].double()
        for first in range(0, 37, page):
            members = k[first : first + page]
            low, high = members.min(0).values, members.max(0).values
            for l in range(ROWS):
                q = query[b, h, l].double()
                bound = sum(max(q[d] * low[d], q[d] * high[d]) for d in range(64))
                scores[b, h, l, first : first + page] = bound
    check(selector, scores, query, key, value)
    assert selector.aux_bits_per_token(SHAPE) == 2 * 64 * 16 / 16 * 2


@pytest.mark.parametrize("name, channels", [("double_sparsity-r2", 2), ("double_sparsity-r8", 8)])
def test_double_sparsity_matches_brute_force(name, channels):
    cal = calibration()
    selector = prepared(name, calibration=cal)
    query, key, value = inputs(4)
    scores = torch.zeros(2, 4, ROWS, KEYS, dtype=torch.float64)
    q_cal, k_cal = cal[0]
    for h in range(4):
        importance = [float(q_cal[0, h, :, c].abs().mean() * k_cal[0, kv_of(h), :, c].abs().mean()) for c in range(64)]
        top = sorted(range(64), key=lambda c: importance[c], reverse=True)[:channels]
        assert selector.layer_channels[0][h].tolist() == sorted(top)
        for b, l, j in itertools.product(range(2), range(ROWS), range(KEYS)):
            scores[b, h, l, j] = sum(float(query[b, h, l, c]) * float(key[b, kv_of(h), j, c]) for c in top)
    check(selector, scores, query, key, value)
    assert selector.aux_bits_per_token(SHAPE) == 16 * channels * 4


def test_double_sparsity_needs_calibration():
    with pytest.raises(SelectorUnavailable, match="calibration"):
        create_selector("double_sparsity-r2").prepare(SelectorSetup(shape=SHAPE))


@pytest.mark.parametrize("bits", [32, 256])
def test_lsh_matches_brute_force_simhash(bits):
    selector = prepared(f"lsh-{bits}")
    query, key, value = inputs(5)
    scores = torch.zeros(2, 4, ROWS, KEYS, dtype=torch.float64)
    (key_w, _), (query_w, _) = selector.projections[0]
    for b, h in itertools.product(range(2), range(4)):
        assert torch.equal(query_w[h], key_w[kv_of(h)])  # queries use their KV head's hyperplanes
        q_bits = query[b, h].double() @ key_w[kv_of(h)].double() > 0
        k_bits = key[b, kv_of(h)].double() @ key_w[kv_of(h)].double() > 0
        scores[b, h] = bits - (q_bits[:, None, :] != k_bits[None, :, :]).sum(-1).double()
    check(selector, scores, query, key, value)
    assert selector.aux_bits_per_token(SHAPE) == bits * 2


def test_lsh_is_deterministic_per_seed():
    a, b = prepared("lsh-32"), prepared("lsh-32")
    assert torch.equal(a.projections[1][0][0], b.projections[1][0][0])
    c = create_selector("lsh-32")
    c.prepare(SelectorSetup(shape=SHAPE, seed=1))
    assert not torch.equal(a.projections[1][0][0], c.projections[1][0][0])


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    dirs = {}
    for key_heads in ("query", "kv"):
        torch.manual_seed(7)
        adapters = HashAdapters.for_model_config(
            type("C", (), dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
                              hidden_size=256))(), key_heads=key_heads, hidden_features=(16,))
        directory = str(tmp_path_factory.mktemp(f"adapters-{key_heads}"))
        adapters.save_pretrained(directory)
        dirs[key_heads] = (directory, adapters)
    return dirs


def _hamming_scores(adapters, query, key, selection_heads):
    adapter = adapters[0]
    q_bits = adapter.query(query.double().float()) > 0  # (B, Hq, P, bits)
    k_bits = adapter.key(adapter.expand_keys(key)) > 0  # (B, Hk, N, bits)
    heads, key_heads = q_bits.shape[1], k_bits.shape[1]
    per_head = torch.stack([
        (q_bits.shape[-1] - (q_bits[:, h, :, None, :] != k_bits[:, h // (heads // key_heads), None, :, :]).sum(-1))
        for h in range(heads)
    ], dim=1).double()
    return per_head.view(per_head.shape[0], selection_heads, heads // selection_heads, *per_head.shape[2:]).sum(2)


@pytest.mark.parametrize("name, key_heads, selection_heads", [
    ("hashattention", "query", 4), ("hashattention-group", "query", 2), ("hashattention-group", "kv", 2),
])
def test_hashattention_matches_brute_force_hamming(adapter_dirs, name, key_heads, selection_heads):
    directory, adapters = adapter_dirs[key_heads]
    setup = {"adapters_dir": adapter_dirs["query"][0]}
    if name.endswith("group"):
        setup["group_adapters_dir"] = directory
    selector = prepared(name, **setup)
    query, key, value = inputs(6)
    with torch.no_grad():
        scores = _hamming_scores(adapters, query, key, selection_heads)
    check(selector, scores, query, key, value)
    # Key signatures are cached and extended: a second call with more keys reuses the first ones.
    longer_query, longer_key, longer_value = inputs(6, keys=KEYS)
    selector.select(0, longer_query, longer_key, longer_value, BUDGET, SCALING)
    assert selector.state[("signatures", 0)].shape[2] == KEYS


def _weighted_hamming_scores(adapters, query, key, levels):
    """Loops in float64: sum over bits of w_j * [query bit == key bit], w_j from the row's |tanh| ranks."""
    adapter = adapters[0]
    q_codes = adapter.query(query.float()).double()  # (B, Hq, P, bits)
    k_bits = adapter.key(adapter.expand_keys(key)) > 0  # (B, Hq, N, bits)
    batch, heads, rows, bits = q_codes.shape
    scores = torch.zeros(batch, heads, rows, k_bits.shape[2], dtype=torch.float64)
    for b, h, l in itertools.product(range(batch), range(heads), range(rows)):
        magnitude = [abs(math.tanh(float(c))) for c in q_codes[b, h, l]]
        top = max(magnitude)
        weights = [min(max(math.ceil(levels * m / top), 1), levels) for m in magnitude]
        q_bits = [float(c) > 0 for c in q_codes[b, h, l]]
        for n in range(k_bits.shape[2]):
            scores[b, h, l, n] = sum(w for w, qb, kb in zip(weights, q_bits, k_bits[b, h, n].tolist()) if qb == kb)
    return scores


@pytest.mark.parametrize("levels", [2, 4])
def test_hashattention_weighted_matches_brute_force_weighted_hamming(adapter_dirs, levels):
    directory, adapters = adapter_dirs["query"]
    selector = prepared(f"hashattention-w{levels}", adapters_dir=directory)
    query, key, value = inputs(8)
    with torch.no_grad():
        scores = _weighted_hamming_scores(adapters, query, key, levels=levels)
        plain = _hamming_scores(adapters, query, key, SHAPE.num_query_heads)
    # The weights reorder keys: some pair is ranked one way by plain Hamming and the other way here.
    assert ((plain[..., :, None] > plain[..., None, :]) & (scores[..., :, None] < scores[..., None, :])).any()
    check(selector, scores, query, key, value)
    assert selector.identity()["query_levels"] == levels
    assert "query_levels" not in prepared("hashattention", adapters_dir=directory).identity()


@pytest.mark.parametrize("options, message", [
    ({"query_levels": -1}, "query_levels must be a non-negative int"),
    ({"query_levels": 2.5}, "query_levels must be a non-negative int"),
    ({"selection": "kv", "query_levels": 4}, "query_levels needs selection='query'"),
])
def test_hashattention_bad_query_levels(options, message):
    from hashattention.evaluation.selectors.hashattention_selector import HashAttentionSelector
    with pytest.raises(ValueError, match=message):
        HashAttentionSelector(**options)


def test_hashattention_without_adapters_is_unavailable(tmp_path):
    with pytest.raises(SelectorUnavailable, match="no trained adapters"):
        create_selector("hashattention").prepare(SelectorSetup(shape=SHAPE, adapters_dir=str(tmp_path)))


@pytest.mark.parametrize("name, recent_fraction", [("h2o", 0.5), ("h2o-heavy-only", 0.0)])
def test_h2o_accumulates_dense_then_sparse_attention(name, recent_fraction):
    """Prefill statistics are column sums of dense attention; each sparse step adds its own probabilities.
    ``h2o`` gives half of the heavy budget to the most recent tokens, as the H2O paper splits its cache."""
    selector = prepared(name)
    keys_total, prefill = 30, 24
    query, key, value = inputs(8, batch=1, keys=keys_total, rows=keys_total)
    selector.observe_dense(0, query[:, :, :prefill], key[:, :, :prefill], SCALING)

    expected = torch.zeros(4, keys_total, dtype=torch.float64)
    def logits(h, p):
        return torch.tensor([float((query[0, h, p].double() * key[0, kv_of(h), j].double()).sum()) * SCALING
                             for j in range(p + 1)], dtype=torch.float64)
    for h, p in itertools.product(range(4), range(prefill)):
        expected[h, : p + 1] += torch.softmax(logits(h, p), 0)
    budget = Budget(1, 2, 4)
    for p in range(prefill, keys_total):
        q, k = query[:, :, p : p + 1], key[:, :, : p + 1]
        indices, counts = selector.select(0, q, k, value[:, :, : p + 1], budget, SCALING)
        scores = expected[None, :, None, : p + 1].clone()
        recent = 2 + int(4 * recent_fraction)
        scores[..., p + 1 - recent :] = float("inf")
        want = brute_force_select(scores, 1, 2, 4)
        assert selected_sets(indices, counts) == want, f"step {p}"
        lse = torch.stack([torch.logsumexp(logits(h, p)[sorted(want[(0, h, 0)])], 0) for h in range(4)]).float()
        selector.observe_sparse(0, q, k, indices, counts, lse[None, :, None], SCALING)
        for h in range(4):
            chosen = sorted(want[(0, h, 0)])
            expected[h, chosen] += torch.softmax(logits(h, p)[chosen], 0)
    torch.testing.assert_close(selector.state[0][0].double(), expected, atol=1e-5, rtol=1e-5)


def test_state_snapshots_are_copies():
    selector = prepared("h2o")
    query, key, _ = inputs(9, batch=1)
    selector.observe_dense(0, query, key[:, :, :ROWS], SCALING)
    saved = selector.save_state()
    selector.observe_dense(0, query, key[:, :, :ROWS], SCALING)
    selector.load_state(saved)
    torch.testing.assert_close(selector.state[0].sum(), torch.tensor(float(ROWS * 4)))
    assert math.isclose(float(saved[0].sum()), ROWS * 4, rel_tol=1e-5)


@pytest.mark.parametrize("rows, keys_total", [(13, 13), (5, 17)])
def test_h2o_dense_statistics_over_row_blocks(monkeypatch, rows, keys_total):
    """Dense prefill statistics computed block by block (each block against only the keys it can see)
    equal the column sums of the full causal attention, for a prefill from an empty cache
    (rows == keys) and for dense rows after cached keys (rows < keys)."""
    from hashattention.evaluation.selectors import h2o

    monkeypatch.setattr(h2o, "_ROW_CHUNK", 4)  # several blocks, the last one partial
    selector = prepared("h2o")
    g = torch.Generator().manual_seed(11)
    query = torch.randn(1, 4, rows, 64, generator=g)
    key = torch.randn(1, 2, keys_total, 64, generator=g)
    selector.observe_dense(0, query, key, SCALING)
    expected = torch.zeros(4, keys_total, dtype=torch.float64)
    for h, r in itertools.product(range(4), range(rows)):
        p = keys_total - rows + r
        logits = (query[0, h, r].double() @ key[0, kv_of(h), : p + 1].double().T) * SCALING
        expected[h, : p + 1] += torch.softmax(logits, 0)
    torch.testing.assert_close(selector.state[0][0].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, follow, selection_heads, keep", [
    ("hashattention-follow", 8, 4, False), ("hashattention-follow-32", 32, 4, False),
    ("hashattention-follow-group", 8, 2, False), ("hashattention-follow-keep", 8, 4, True)])
def test_hashattention_follow_forces_the_successors_of_the_last_rows_strongest_keys(adapter_dirs, name, follow,
                                                                                    selection_heads, keep):
    """Per step: plain Hamming scores (per query head, or summed over a KV group), with +inf at p + 1 for the
    `follow` keys p of largest logit that each query head's previous row attended to (the prefill's last row:
    among all its keys; a sparse row: among the keys its selection chose; a group forces the union of its
    heads' successors; with `keep`, at p as well), computed here by loops in float64."""
    directory, adapters = adapter_dirs["query"]
    selector = prepared(name, adapters_dir=directory)
    assert selector.identity()["follow_tokens"] == follow
    keys_total, prefill = 60, 50
    query, key, value = inputs(11, batch=1, keys=keys_total, rows=keys_total)
    selector.observe_dense(0, query[:, :, :prefill], key[:, :, :prefill], SCALING)
    group = 4 // selection_heads

    def logit(h, p, j):
        return float((query[0, h, p].double() * key[0, kv_of(h), j].double()).sum()) * SCALING

    def strongest(h, p, candidates):
        return sorted(candidates, key=lambda j: logit(h, p, j), reverse=True)[:follow]

    followed = {h: strongest(h, prefill - 1, range(prefill)) for h in range(4)}
    budget = Budget(1, 2, 12)
    forced = 0
    for p in range(prefill, keys_total):
        q, k = query[:, :, p : p + 1], key[:, :, : p + 1]
        indices, counts = selector.select(0, q, k, value[:, :, : p + 1], budget, SCALING)
        with torch.no_grad():
            scores = _hamming_scores(adapters, q, k, selection_heads)
        for h in range(4):
            for j in followed[h][: budget.heavy_tokens]:
                if j + 1 <= p:
                    scores[0, h // group, 0, j + 1] = float("inf")
                    forced += 1
                if keep:
                    scores[0, h // group, 0, j] = float("inf")
        want = brute_force_select(scores, 1, 2, 12)
        assert selected_sets(indices, counts) == want, f"step {p}"
        _, lse = torch.ops.hashattention.sparse_attention.default(q, k, value[:, :, : p + 1], indices, counts, None,
                                                                   SCALING, None)
        selector.observe_sparse(0, q, k, indices, counts, lse, SCALING)
        followed = {h: strongest(h, p, sorted(want[(0, h // group, 0)])) for h in range(4)}
    assert forced > 0


def test_hashattention_follow_rejects_a_bad_count():
    from hashattention.evaluation.selectors.hashattention_follow import FollowAttended
    with pytest.raises(ValueError, match="follow_tokens must be a positive int"):
        FollowAttended(follow_tokens=0)
    with pytest.raises(ValueError, match="keep_attended must be a bool"):
        FollowAttended(keep_attended=1)


@pytest.mark.parametrize("name, factor", [("hashattention-rerank-2", 2), ("hashattention-rerank-4", 4)])
def test_hashattention_rerank_keeps_the_best_exact_logits_among_the_hamming_candidates(adapter_dirs, name, factor):
    """Stage 1: sink + local + factor * m by Hamming score (brute force); stage 2: of those candidates outside
    the windows, the m largest float64 logits q . k * scaling (ties to the later position)."""
    directory, adapters = adapter_dirs["query"]
    selector = prepared(name, adapters_dir=directory)
    assert selector.identity()["candidate_factor"] == factor
    query, key, value = inputs(9)
    with torch.no_grad():
        hamming = _hamming_scores(adapters, query, key, selection_heads=4)
    stage_one = brute_force_select(hamming, BUDGET.sink_tokens, BUDGET.local_tokens, BUDGET.heavy_tokens * factor)
    windows = brute_force_select(hamming, BUDGET.sink_tokens, BUDGET.local_tokens, 0)
    expected = {}
    for (b, h, l), candidates in stage_one.items():
        logit = lambda j: float((query[b, h, l].double() * key[b, kv_of(h), j].double()).sum()) * SCALING
        ranked = sorted(candidates - windows[(b, h, l)], key=lambda j: (logit(j), j), reverse=True)
        expected[(b, h, l)] = windows[(b, h, l)] | set(ranked[: BUDGET.heavy_tokens])
    indices, counts = selector.select(0, query, key, value, BUDGET, SCALING)
    assert selected_sets(indices, counts) == expected
    # The re-rank changes the choice: the exact logits do not pick the Hamming top-m on these inputs.
    assert expected != brute_force_select(hamming, BUDGET.sink_tokens, BUDGET.local_tokens, BUDGET.heavy_tokens)


def test_hashattention_rerank_rejects_a_bad_factor():
    from hashattention.evaluation.selectors.hashattention_rerank import RerankedHashAttention
    with pytest.raises(ValueError, match="candidate_factor must be a positive int"):
        RerankedHashAttention(candidate_factor=0)
