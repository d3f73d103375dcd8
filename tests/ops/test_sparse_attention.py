"""sparse_attention against the float64 reference, HF and paged layouts."""

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hashattention as ha
from hashattention import reference
from op_helpers import ATTENTION_TOLERANCE, assert_close_verbose, capture_cuda_graph, generator_for

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_index_lists(batch, heads, rows, width, keys, generator, with_counts=True):
    """Sorted distinct positions per row, a random count each, -1 padding after it."""
    indices = torch.full((batch, heads, rows, width), -1, dtype=torch.int32)
    counts = torch.zeros(batch, heads, rows, dtype=torch.int32)
    for flat in range(batch * heads * rows):
        b, rest = divmod(flat, heads * rows)
        h, l = divmod(rest, rows)
        count = int(torch.randint(0, min(width, keys) + 1, (1,), generator=generator)) if keys else 0
        if flat == 0 and keys:
            count = min(width, keys)  # at least one full row per case
        chosen = torch.randperm(keys, generator=generator)[:count].sort().values
        indices[b, h, l, :count] = chosen.to(torch.int32)
        counts[b, h, l] = count
    return indices, counts


def check_attention(got, expected, dtype, what):
    out, lse = got
    ref_out, ref_lse = expected
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_verbose(out, ref_out, what=f"{what} out", **ATTENTION_TOLERANCE[dtype])
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), f"{what}: empty rows must give lse = -inf"
    assert (lse.cpu()[~finite] == float("-inf")).all()
    assert_close_verbose(lse.cpu()[finite], ref_lse[finite], what=f"{what} lse", atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_heads,kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("group_shared", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("keys,rows,batch,width", [(1, 1, 1, 1), (60, 5, 3, 24), (700, 1, 1, 300), (2000, 5, 1, 160)])
def test_hf_layout_matches_reference(device, dtype, query_heads, kv_heads, group_shared, head_dim, keys, rows,
                                     batch, width):
    case = ("attn-hf", device, dtype, query_heads, kv_heads, group_shared, head_dim, keys, rows, batch, width)
    g = generator_for(*case)
    selection_heads = kv_heads if group_shared else query_heads
    q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    indices, counts = random_index_lists(batch, selection_heads, rows, width, keys, g)
    scale = head_dim**-0.5
    expected = reference.sparse_attention(q, k, v, indices, counts, scale=scale)
    got = ha.sparse_attention(q.to(device), k.to(device), v.to(device), indices.to(device), counts.to(device),
                              scale=scale)
    check_attention(got, expected, dtype, repr(case))
    # without counts: every entry is read and the -1 padding skipped -- same result
    got = ha.sparse_attention(q.to(device), k.to(device), v.to(device), indices.to(device), scale=scale)
    check_attention(got, expected, dtype, repr(case) + " without counts")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_strided_cache_and_query_read_in_place(device, dtype, head_dim):
    """A slice of a preallocated (B, Hkv, N_max, D) cache and a transposed (B, L, Hq, D) query."""
    g = generator_for("attn-strided", device, dtype, head_dim)
    cache_k = torch.randn(2, 2, 128, head_dim, generator=g).to(dtype)
    cache_v = torch.randn(2, 2, 128, head_dim, generator=g).to(dtype)
    k, v = cache_k[:, :, :90], cache_v[:, :, :90]
    q = torch.randn(2, 3, 8, head_dim, generator=g).to(dtype).transpose(1, 2)  # (B, Hq=8, L=3, D) view
    indices, counts = random_index_lists(2, 8, 3, 40, 90, g)
    scale = 0.3
    expected = reference.sparse_attention(q, k, v, indices, counts, scale=scale)
    got = ha.sparse_attention(q.to(device), k.to(device), v.to(device), indices.to(device), counts.to(device),
                              scale=scale)
    check_attention(got, expected, dtype, "strided")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group_shared", [False, True])
def test_paged_layout_matches_reference(device, dtype, page_size, group_shared):
    g = generator_for("attn-paged", device, dtype, page_size, group_shared)
    batch, query_heads, kv_heads, rows, head_dim, keys = 3, 8, 2, 5, 128, 300
    max_pages = -(-keys // page_size)
    num_pages = batch * max_pages + 7
    block_table = torch.randperm(num_pages, generator=g)[: batch * max_pages].reshape(batch, max_pages).to(torch.int32)
    k_pages = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(dtype)
    v_pages = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(dtype)
    selection_heads = kv_heads if group_shared else query_heads
    q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
    indices, counts = random_index_lists(batch, selection_heads, rows, 64, keys, g)
    scale = head_dim**-0.5
    expected = reference.sparse_attention(q, k_pages, v_pages, indices, counts, scale=scale, block_table=block_table)
    got = ha.sparse_attention(q.to(device), k_pages.to(device), v_pages.to(device), indices.to(device),
                              counts.to(device), scale=scale, block_table=block_table.to(device))
    check_attention(got, expected, dtype, f"paged page_size={page_size}")


def test_paged_equals_hf_layout(device):
    """The same cache laid out both ways gives the same result."""
    g = generator_for("paged-vs-hf", device)
    batch, kv_heads, keys, head_dim, page_size = 2, 2, 64, 64, 8
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=g)
    pages = keys // page_size
    block_table = torch.arange(batch * pages, dtype=torch.int32).flip(0).reshape(batch, pages)
    k_pages = torch.empty(batch * pages, page_size, kv_heads, head_dim)
    v_pages = torch.empty_like(k_pages)
    for b in range(batch):
        for p in range(pages):
            k_pages[block_table[b, p]] = k[b, :, p * page_size:(p + 1) * page_size].transpose(0, 1)
            v_pages[block_table[b, p]] = v[b, :, p * page_size:(p + 1) * page_size].transpose(0, 1)
    q = torch.randn(batch, 4, 1, head_dim, generator=g)
    indices, counts = random_index_lists(batch, 4, 1, 20, keys, g)
    args = [t.to(device) for t in (indices, counts)]
    hf = ha.sparse_attention(q.to(device), k.to(device), v.to(device), *args, scale=0.125)
    paged = ha.sparse_attention(q.to(device), k_pages.to(device), v_pages.to(device), *args, scale=0.125,
                                block_table=block_table.to(device))
    torch.testing.assert_close(hf[0], paged[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hf[1], paged[1], atol=1e-6, rtol=1e-6)


def test_empty_selection_gives_zero_and_minus_inf(device):
    q = torch.randn(1, 2, 1, 64)
    k = torch.randn(1, 2, 10, 64)
    indices = torch.full((1, 2, 1, 4), -1, dtype=torch.int32)
    counts = torch.zeros(1, 2, 1, dtype=torch.int32)
    out, lse = ha.sparse_attention(q.to(device), k.to(device), k.to(device), indices.to(device), counts.to(device),
                                   scale=0.1)
    assert (out.cpu() == 0).all() and (lse.cpu() == float("-inf")).all()


NAN, INF = float("nan"), float("inf")
COLUMN = 7  # the element of a K/V row, or of a query, that a case makes non-finite
ALL = slice(None)

# The (sequence b, query head h, row l) a non-finite case targets, its KV head, one of its selected
# positions, and the positions that no list selects.
Target = namedtuple("Target", "b h l kv position unselected")


def put(tensor, index, value):
    tensor[index] = value


# What each case puts where, on (query, keys, values) in the HF layout, for the Target t; returns the
# scale to use (None: the default).
NON_FINITE_CASES = {
    "nan query": lambda q, k, v, t: put(q, (t.b, t.h, t.l, COLUMN), NAN),
    "inf query": lambda q, k, v, t: put(q, (t.b, t.h, t.l, COLUMN), INF),
    "nan selected key": lambda q, k, v, t: put(k, (t.b, t.kv, t.position, COLUMN), NAN),
    "inf selected key": lambda q, k, v, t: put(k, (t.b, t.kv, t.position, COLUMN), INF),
    "-inf selected key": lambda q, k, v, t: put(k, (t.b, t.kv, t.position, COLUMN), -INF),
    "nan selected value": lambda q, k, v, t: put(v, (t.b, t.kv, t.position, COLUMN), NAN),
    "inf selected value": lambda q, k, v, t: put(v, (t.b, t.kv, t.position, COLUMN), INF),
    "nan in unselected rows": lambda q, k, v, t: put(k, (ALL, ALL, t.unselected), NAN) or put(
        v, (ALL, ALL, t.unselected), NAN),
    # q . k = -inf for every key of the KV head: dense attention (SDPA's math backend) gives out = 0, lse = -inf
    "every logit -inf": lambda q, k, v, t: put(q, (t.b, t.h, t.l, 0), INF) or put(
        k, (t.b, t.kv, ALL, 0), -k[t.b, t.kv, :, 0].abs() - 0.5),
    "nan scale": lambda q, k, v, t: NAN,
    "inf scale": lambda q, k, v, t: INF,
    "-inf scale": lambda q, k, v, t: -INF,
}
# The target row's expected out and lse where the case decides them (the reference must agree):
# "nan" the whole row, "column nan" / "column inf" only out[..., COLUMN] (lse finite).
TARGET_OUTCOME = {
    "nan query": "nan", "nan selected key": "nan", "nan scale": "nan",
    "nan selected value": "column nan", "inf selected value": "column inf",
    "nan in unselected rows": "finite", "every logit -inf": "zero",
}


def shuffled_block_table(batch, keys, page_size, generator):
    """int32 (B, ceil(N / page_size)): distinct pages in random order, 3 pages of the pool unused."""
    pages = -(-keys // page_size)
    return torch.randperm(batch * pages + 3, generator=generator)[: batch * pages].reshape(batch, pages).to(torch.int32)


def paged_copy(cache, block_table, page_size):
    """The HF-layout cache (B, Hkv, N, D) as pages (num_pages, page_size, Hkv, D) addressed by block_table."""
    batch, kv_heads, keys, head_dim = cache.shape
    paged = torch.zeros(int(block_table.max()) + 4, page_size, kv_heads, head_dim, dtype=cache.dtype)
    for b in range(batch):
        for page in range(block_table.shape[1]):
            rows = cache[b, :, page * page_size:(page + 1) * page_size].transpose(0, 1)
            paged[block_table[b, page], : rows.shape[0]] = rows
    return paged


def check_non_finite(got, expected, dtype, what):
    """out and lse equal the reference, NaN where it is NaN and +-inf where it is +-inf."""
    out, lse = (t.cpu().double() for t in got)
    ref_out, ref_lse = expected
    torch.testing.assert_close(out, ref_out, equal_nan=True, msg=lambda m: f"{what} out: {m}",
                               **ATTENTION_TOLERANCE[dtype])
    torch.testing.assert_close(lse, ref_lse, equal_nan=True, atol=2e-4, rtol=2e-4, msg=lambda m: f"{what} lse: {m}")


def check_target_outcome(case, out, lse, t):
    outcome = TARGET_OUTCOME.get(case)
    row, row_lse = out[t.b, t.h, t.l].double().cpu(), float(lse[t.b, t.h, t.l])
    others = torch.arange(row.numel()) != COLUMN
    if outcome == "nan":
        assert row.isnan().all() and row_lse != row_lse, f"{case}: out {row[:4]}, lse {row_lse}"
    elif outcome in ("column nan", "column inf"):
        assert (row[COLUMN].isnan() if outcome == "column nan" else row[COLUMN] == INF), f"{case}: {row[COLUMN]}"
        assert row[others].isfinite().all() and abs(row_lse) != INF, f"{case}: out {row[:4]}, lse {row_lse}"
    elif outcome == "finite":
        assert row.isfinite().all() and abs(row_lse) != INF, f"{case}: out {row[:4]}, lse {row_lse}"
    elif outcome == "zero":
        assert (row == 0).all() and row_lse == -INF, f"{case}: out {row[:4]}, lse {row_lse}"


def non_finite_inputs(case, dtype, query_heads, kv_heads, group_shared, head_dim, keys, width, generator):
    """Inputs with `case` applied to one (sequence, head, row), an empty list in another, and the target."""
    batch, rows = 2, 2
    selection_heads = kv_heads if group_shared else query_heads
    q = torch.randn(batch, query_heads, rows, head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=generator).to(dtype)
    selectable = keys - 10  # the last 10 positions are never selected
    indices, counts = random_index_lists(batch, selection_heads, rows, width, selectable, generator)
    counts[1, -1, 0] = 0  # an empty list: out = 0, lse = -inf, whatever the other rows hold
    indices[1, -1, 0] = -1
    # The target is query head 0 of row 0 of sequence 0, whose list random_index_lists fills.
    position = int(indices[0, 0, 0, int(counts[0, 0, 0]) // 2])  # mid-list: a middle split on CUDA
    target = Target(0, 0, 0, 0, position, torch.arange(selectable, keys))
    scale = NON_FINITE_CASES[case](q, k, v, target)
    return q, k, v, indices, counts, (head_dim**-0.5 if scale is None else scale), target


@pytest.mark.parametrize("case", list(NON_FINITE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_shared", [False, True])
@pytest.mark.parametrize("page_size", [None, 16])
def test_non_finite_inputs_propagate_as_in_dense_attention(device, case, dtype, group_shared, page_size):
    """A NaN or infinity in the query, a selected K/V row or the scale gives what dense attention
    gives (NaN, or inf where a value is infinite), not the empty row's out = 0, lse = -inf; rows
    not selected do not matter, and an empty list still gives 0 and -inf."""
    g = generator_for("attn-non-finite", device, case, dtype, group_shared, page_size)
    q, k, v, indices, counts, scale, target = non_finite_inputs(case, dtype, 4, 2, group_shared, 64, 50, 24, g)
    expected = reference.sparse_attention(q, k, v, indices, counts, scale=scale)
    check_target_outcome(case, *expected, target)
    assert (expected[0][1, -1, 0] == 0).all() and expected[1][1, -1, 0] == -INF
    layout = {}
    if page_size is not None:
        block_table = shuffled_block_table(k.shape[0], k.shape[2], page_size, g)
        k, v = paged_copy(k, block_table, page_size), paged_copy(v, block_table, page_size)
        layout = dict(block_table=block_table.to(device))
    for with_counts in (True, False):
        got = ha.sparse_attention(q.to(device), k.to(device), v.to(device), indices.to(device),
                                  counts.to(device) if with_counts else None, scale=scale, **layout)
        check_non_finite(got, expected, dtype, f"{case}, counts={with_counts}")


@pytest.mark.parametrize("case", list(NON_FINITE_CASES))
def test_reference_is_dense_attention_on_non_finite_inputs(case):
    """With every position selected, the float64 reference gives what SDPA's math backend gives, and
    torch.logsumexp of the scaled logits: the oracle of the test above is dense attention."""
    g = generator_for("reference-vs-sdpa", case)
    q, k, v, _, _, scale, target = non_finite_inputs(case, torch.float64, 4, 2, False, 64, 50, 24, g)
    selectable = int(target.unselected[0])
    k, v = (t[:, :, :selectable].repeat_interleave(2, dim=1) for t in (k, v))  # (B, Hq, N, D)
    indices = torch.arange(selectable, dtype=torch.int32).expand(2, 4, 2, selectable).contiguous()
    out, lse = reference.sparse_attention(q, k, v, indices, scale=scale)
    with sdpa_kernel(SDPBackend.MATH):
        dense = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(out, dense, equal_nan=True)
    torch.testing.assert_close(lse, torch.logsumexp((q * scale) @ k.transpose(-1, -2), dim=-1), equal_nan=True)


def test_lse_merges_two_halves_into_the_whole(device):
    """Splitting a selection in two and merging by log-sum-exp gives attention over the union."""
    g = generator_for("lse-merge", device)
    q = torch.randn(1, 4, 1, 128, generator=g).to(device)
    k = torch.randn(1, 4, 200, 128, generator=g).to(device)
    v = torch.randn(1, 4, 200, 128, generator=g).to(device)
    everything = torch.arange(200, dtype=torch.int32).expand(1, 4, 1, 200).contiguous().to(device)
    whole, whole_lse = ha.sparse_attention(q, k, v, everything, scale=0.09)
    a, a_lse = ha.sparse_attention(q, k, v, everything[..., :77].contiguous(), scale=0.09)
    b, b_lse = ha.sparse_attention(q, k, v, everything[..., 77:].contiguous(), scale=0.09)
    merged_lse = torch.logaddexp(a_lse, b_lse)
    merged = a * (a_lse - merged_lse).exp()[..., None] + b * (b_lse - merged_lse).exp()[..., None]
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-5, rtol=1e-5)


cuda_only = pytest.mark.skipif(not (torch.cuda.is_available() and ha.WITH_CUDA), reason="needs a CUDA build and a GPU")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("query_heads,kv_heads,group_shared", [(8, 2, False), (8, 2, True), (16, 2, True), (12, 2, True)])
@pytest.mark.parametrize("blocks_per_sm,min_rows", [(None, None), ("1", "1"), ("16", "1"), ("4", "100000")])
@pytest.mark.parametrize("cluster", [None, "0", "3"])
def test_launch_shapes_give_the_reference(monkeypatch, dtype, head_dim, query_heads, kv_heads, group_shared,
                                          blocks_per_sm, min_rows, cluster):
    """Every split count and every share of steps per warp (environment overrides of
    csrc/environment_overrides.h force few large splits, or many of a few rows) computes the same attention: one and several
    heads per block (plain and pipelined loops), partial steps and tiles, empty and full lists, with
    the splits merged in a thread-block cluster (up to 16, or up to 3 splits) or through the counters
    (cluster "0")."""
    if blocks_per_sm is not None:
        monkeypatch.setenv("HASHATTENTION_ATTENTION_BLOCKS_PER_SM", blocks_per_sm)
        monkeypatch.setenv("HASHATTENTION_ATTENTION_MIN_ROWS", min_rows)
    if cluster is not None:
        monkeypatch.setenv("HASHATTENTION_ATTENTION_CLUSTER", cluster)
    case = ("attn-launch", dtype, head_dim, query_heads, kv_heads, group_shared, blocks_per_sm, min_rows, cluster)
    g = generator_for(*case)
    batch, rows, keys, width = 2, 2, 5000, 1531
    selection_heads = kv_heads if group_shared else query_heads
    q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
    indices, counts = random_index_lists(batch, selection_heads, rows, width, keys, g)
    counts[-1, -1, -1] = 0  # an empty list
    indices[-1, -1, -1] = -1
    scale = head_dim**-0.5
    expected = reference.sparse_attention(q, k, v, indices, counts, scale=scale)
    got = ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), indices.cuda(), counts.cuda(), scale=scale)
    check_attention(got, expected, dtype, repr(case))


@cuda_only
@pytest.mark.parametrize("case", list(NON_FINITE_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("query_heads,kv_heads,group_shared", [(8, 2, False), (8, 2, True)])
@pytest.mark.parametrize("merge", ["one split", "cluster", "clusters of 3", "counters"])
def test_non_finite_inputs_in_every_merge_path(monkeypatch, case, dtype, query_heads, kv_heads, group_shared, merge):
    """Non-finite inputs propagate through every way the CUDA kernel combines partial softmax states:
    row groups and warps of a block, then the splits of a long list merged in one thread-block
    cluster (up to 16 splits, or clusters of at most 3) or through the counters; one head per block
    and several (the pipelined loop). The target position sits mid-list, in a middle split."""
    if merge == "one split":
        monkeypatch.setenv("HASHATTENTION_ATTENTION_MIN_ROWS", "100000")
    else:
        monkeypatch.setenv("HASHATTENTION_ATTENTION_BLOCKS_PER_SM", "16")
        monkeypatch.setenv("HASHATTENTION_ATTENTION_MIN_ROWS", "1")
        cluster = {"cluster": "16", "clusters of 3": "3", "counters": "0"}[merge]
        monkeypatch.setenv("HASHATTENTION_ATTENTION_CLUSTER", cluster)
    g = generator_for("attn-non-finite-merge", case, dtype, query_heads, kv_heads, group_shared, merge)
    q, k, v, indices, counts, scale, target = non_finite_inputs(case, dtype, query_heads, kv_heads, group_shared, 128,
                                                                3000, 1200, g)
    expected = reference.sparse_attention(q, k, v, indices, counts, scale=scale)
    check_target_outcome(case, *expected, target)
    got = ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), indices.cuda(), counts.cuda(), scale=scale)
    check_non_finite(got, expected, dtype, f"{case}, {merge}")


@cuda_only
@pytest.mark.parametrize("variable, value", [
    ("HASHATTENTION_ATTENTION_BLOCKS_PER_SM", "0"),
    ("HASHATTENTION_ATTENTION_MIN_ROWS", "many"),
    ("HASHATTENTION_ATTENTION_CLUSTER", "17"),
])
def test_bad_override_values_are_named(monkeypatch, variable, value):
    """The attention's environment overrides reject what they cannot mean, naming the variable."""
    monkeypatch.setenv(variable, value)
    q = torch.randn(1, 4, 1, 64, device="cuda")
    k = torch.randn(1, 4, 300, 64, device="cuda")
    indices = torch.arange(200, dtype=torch.int32, device="cuda").expand(1, 4, 1, 200).contiguous()
    with pytest.raises(RuntimeError, match=f"{variable} must be an integer"):
        ha.sparse_attention(q, k, k, indices, scale=0.125)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("query_heads,kv_heads,group_shared", [(8, 2, False), (8, 2, True)])
def test_workspace_counters_are_reused_and_left_zero(monkeypatch, dtype, query_heads, kv_heads, group_shared):
    """With a caller's zeroed workspace the split counters are not cleared by a memset: each unit's
    last split resets its counter. Repeated calls (and CUDA-graph replays with new inputs) through
    one workspace must keep giving the reference, and leave the workspace zero -- a counter left
    behind would make a later call merge before all its splits are done. The counters' merge is
    forced (no clusters) with many small splits, on a workspace larger than needed."""
    monkeypatch.setenv("HASHATTENTION_ATTENTION_CLUSTER", "0")
    monkeypatch.setenv("HASHATTENTION_ATTENTION_BLOCKS_PER_SM", "16")
    monkeypatch.setenv("HASHATTENTION_ATTENTION_MIN_ROWS", "1")
    g = generator_for("attn-workspace", dtype, query_heads, kv_heads, group_shared)
    batch, rows, keys, width, head_dim = 2, 3, 4000, 1200, 128
    selection_heads = kv_heads if group_shared else query_heads
    workspace = torch.zeros(batch * query_heads * rows + 5, dtype=torch.int32, device="cuda")

    def inputs():
        q = torch.randn(batch, query_heads, rows, head_dim, generator=g).to(dtype)
        k = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
        v = torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(dtype)
        indices, counts = random_index_lists(batch, selection_heads, rows, width, keys, g)
        return q, k, v, indices, counts

    for call in range(3):
        q, k, v, indices, counts = inputs()
        expected = reference.sparse_attention(q, k, v, indices, counts, scale=head_dim**-0.5)
        got = ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), indices.cuda(), counts.cuda(), scale=head_dim**-0.5,
                                  workspace=workspace)
        check_attention(got, expected, dtype, f"eager call {call}")
        assert not workspace.any(), f"eager call {call} left split counters behind"

    static = [t.cuda() for t in inputs()]
    graph, out = capture_cuda_graph(lambda: ha.sparse_attention(*static, scale=head_dim**-0.5, workspace=workspace))
    for replay in range(3):
        fresh = inputs()
        for target, source in zip(static, fresh):
            target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        check_attention(out, reference.sparse_attention(*fresh, scale=head_dim**-0.5), dtype, f"replay {replay}")
        assert not workspace.any(), f"replay {replay} left split counters behind"
