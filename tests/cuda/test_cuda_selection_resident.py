"""The one-launch (resident) path of the CUDA hamming_topk against the CPU kernel.

hamming_topk takes this path when the whole selection fits on chip: one-word signatures with
16-byte-aligned contiguous key rows, 1, 2 or 4 query heads per selection head, and about 25M
positions in all on an H200 (a batch-1 decode step). Blocks cover 4K to 64K positions (chosen from
the grid size; HASHATTENTION_SELECTION_CHUNK forces one size, so every size is
tested), so the shapes here put rows on both sides of those sizes and of the capacity, with ragged lengths, odd start offsets (partial first and last groups of four),
per-sequence budgets, several query rows, few distinct signatures (ties at the threshold span
many blocks), the budget edge cases (nothing heavy, every candidate kept) and problems cut into
several launches (HASHATTENTION_SELECTION_RESIDENT_BLOCKS shrinks the grid). Each case also
runs with HASHATTENTION_SELECTION=chunked (the two-kernel path) and the two must agree.
The CPU kernel is the reference (itself checked against hashattention.reference). Skipped
without a GPU.
"""

import pytest
import torch

import hashattention as ha
from op_helpers import generator_for

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ha.WITH_CUDA), reason="needs a GPU and the CUDA kernels"
)


def signatures(shape, g, pool: int = 0):
    """int32 signatures; pool > 0 draws them from that many distinct values (many ties)."""
    values = torch.randint(-2**31, 2**31 - 1, (pool,) if pool else shape, generator=g, dtype=torch.int64)
    values = values.to(torch.int32)
    return values[torch.randint(0, pool, shape, generator=g)] if pool else values


def select(device, q_sig, k_sig, lengths, starts, budgets, **kwargs):
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ha.hamming_topk(to(q_sig), to(k_sig), lengths=to(lengths), start_positions=to(starts),
                           budgets=to(budgets), **kwargs)


def check(monkeypatch, q_sig, k_sig, selection_heads, budget, lengths=None, starts=None, budgets=None, sink=128,
          local=128):
    kwargs = dict(selection_heads=selection_heads, sink_tokens=sink, local_tokens=local, budget_tokens=budget)
    expected = select("cpu", q_sig, k_sig, lengths, starts, budgets, **kwargs)
    monkeypatch.delenv("HASHATTENTION_SELECTION", raising=False)
    resident = select("cuda", q_sig, k_sig, lengths, starts, budgets, **kwargs)
    monkeypatch.setenv("HASHATTENTION_SELECTION", "chunked")
    chunked = select("cuda", q_sig, k_sig, lengths, starts, budgets, **kwargs)
    for name, got in (("resident", resident), ("chunked", chunked)):
        assert torch.equal(got[1].cpu(), expected[1]), f"{name}: counts differ from the CPU kernel"
        differ = (got[0].cpu() != expected[0]).nonzero()
        assert differ.numel() == 0, f"{name}: {differ.shape[0]} index entries differ, first at {differ[0].tolist()}"


@pytest.mark.parametrize("keys", [1, 6, 257, 4096, 4099, 8191, 16_385, 65_539, 131_072])
@pytest.mark.parametrize("pool", [0, 3])
def test_per_query_head_batch_1(monkeypatch, keys, pool):
    """The decode step of the benchmark: 32 selection heads with their own key heads, one row."""
    g = generator_for("resident-per-head", keys, pool)
    q_sig = signatures((1, 32, 1, 1), g, pool)
    k_sig = signatures((1, 32, keys, 1), g, pool)
    check(monkeypatch, q_sig, k_sig, 32, max(keys // 32 - 256, 1))


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("keys", [5_000, 70_001])
@pytest.mark.parametrize("pool", [0, 4])
def test_group_shared(monkeypatch, group, keys, pool):
    """Selection heads of `group` query heads: distances are sums of `group` popcounts."""
    g = generator_for("resident-group", group, keys, pool)
    kv_heads = 8
    q_sig = signatures((1, kv_heads * group, 1, 1), g, pool)
    k_sig = signatures((1, kv_heads, keys, 1), g, pool)
    check(monkeypatch, q_sig, k_sig, kv_heads, keys // 16)


def test_query_heads_sharing_key_heads(monkeypatch):
    """Per-query-head selection over per-KV-head key signatures (4 selection heads read one key row)."""
    g = generator_for("resident-sharing")
    q_sig = signatures((2, 16, 1, 1), g)
    k_sig = signatures((2, 4, 30_000, 1), g)
    check(monkeypatch, q_sig, k_sig, 16, 1_000)


@pytest.mark.parametrize("pool", [0, 2])
def test_ragged_batch_rows_starts_and_budgets(monkeypatch, pool):
    g = generator_for("resident-ragged", pool)
    keys = 30_001
    q_sig = signatures((3, 8, 3, 1), g, pool)
    k_sig = signatures((3, 8, keys, 1), g, pool)
    lengths = torch.tensor([keys, 17_777, 301], dtype=torch.int32)
    starts = torch.tensor([0, 1_235, 7], dtype=torch.int32)
    budgets = torch.tensor([2_000, 333, 5_000], dtype=torch.int32)
    check(monkeypatch, q_sig, k_sig, 8, 4_096, lengths, starts, budgets, sink=5, local=9)


@pytest.mark.parametrize("budget", [0, 1, 99_000, 200_000])
def test_budget_edges(monkeypatch, budget):
    """No heavy tokens, one, almost every candidate, and every candidate (no scores needed)."""
    g = generator_for("resident-budget", budget)
    keys = 100_003
    q_sig = signatures((1, 4, 1, 1), g, 5)
    k_sig = signatures((1, 4, keys, 1), g, 5)
    check(monkeypatch, q_sig, k_sig, 4, budget, sink=3, local=2)


def test_every_candidate_tied(monkeypatch):
    """All signatures equal: the heavy picks are the latest candidates, across all blocks."""
    keys = 100_003
    q_sig = torch.zeros(1, 4, 1, 1, dtype=torch.int32)
    k_sig = torch.zeros(1, 4, keys, 1, dtype=torch.int32)
    check(monkeypatch, q_sig, k_sig, 4, 12_345, sink=3, local=2)


@pytest.mark.parametrize("keys", [140_000, 600_000, 1_000_000])
def test_long_rows_and_beyond_capacity(monkeypatch, keys):
    """32 rows of 140K / 600K positions (16K- and 64K-position blocks) and of 1M (past the capacity of one
    launch: grid slices of 16 rows)."""
    g = generator_for("resident-capacity", keys)
    q_sig = signatures((1, 32, 1, 1), g)
    k_sig = signatures((1, 32, keys, 1), g)
    check(monkeypatch, q_sig, k_sig, 32, keys // 32 - 256)


@pytest.mark.parametrize("chunk", [4096, 8192, 16384, 32768, 65536])
@pytest.mark.parametrize("pool", [0, 3])
def test_every_chunk_size_on_static_cache_slots(monkeypatch, chunk, pool):
    """Each block size, forced, on a static cache's layout: slots a little past a power of two
    (a model's n + decode steps, so each row's last block is nearly empty), shorter per-sequence
    lengths and budgets given as tensors, as a patched model's decode step calls it. Blocks of up
    to 32K positions write from registers after one pass; 64K blocks take the general two-pass
    compaction."""
    monkeypatch.setenv("HASHATTENTION_SELECTION_CHUNK", str(chunk))
    g = generator_for("resident-chunk", chunk, pool)
    slots = 65_536 + 132
    q_sig = signatures((2, 8, 1, 1), g, pool)
    k_sig = signatures((2, 8, slots, 1), g, pool)
    lengths = torch.tensor([65_536 + 5, 40_003], dtype=torch.int32)
    starts = torch.tensor([0, 3], dtype=torch.int32)
    budgets = torch.tensor([65_541 // 32 - 256, 40_003 // 32 - 256], dtype=torch.int32)
    check(monkeypatch, q_sig, k_sig, 8, slots // 32 - 256, lengths, starts, budgets)


@pytest.mark.parametrize("resident_blocks", [24, 6, 1])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("pool", [0, 3])
def test_grid_slices(monkeypatch, resident_blocks, group, pool):
    """A problem larger than one resident grid is cut into launches: whole batches per slice (24
    blocks: 3 batches of 8 head rows, one 32K-position block each, then 2), one batch's head rows
    per slice (6 blocks: 4 rows), or one row per launch (1 block). Ragged lengths, starts and
    budgets, so that slices differ."""
    monkeypatch.setenv("HASHATTENTION_SELECTION_RESIDENT_BLOCKS", str(resident_blocks))
    g = generator_for("resident-slices", resident_blocks, group, pool)
    keys, kv_heads = 20_001, 4
    q_sig = signatures((5, kv_heads * group, 2, 1), g, pool)
    k_sig = signatures((5, kv_heads, keys, 1), g, pool)
    lengths = torch.tensor([keys, 17_777, 301, 9_000, keys - 2], dtype=torch.int32)
    starts = torch.tensor([0, 1_235, 7, 0, 2], dtype=torch.int32)
    budgets = torch.tensor([2_000, 333, 5_000, 4_097, 1], dtype=torch.int32)
    check(monkeypatch, q_sig, k_sig, kv_heads, 4_096, lengths, starts, budgets, sink=5, local=9)


@pytest.mark.parametrize("variable, value, message", [
    ("HASHATTENTION_SELECTION", "resident", "HASHATTENTION_SELECTION must be chunked, got 'resident'"),
    ("HASHATTENTION_SELECTION_CHUNK", "5000",
     "HASHATTENTION_SELECTION_CHUNK must be 4096, 8192, 16384, 32768 or 65536, got '5000'"),
    ("HASHATTENTION_SELECTION_RESIDENT_BLOCKS", "0",
     r"HASHATTENTION_SELECTION_RESIDENT_BLOCKS must be an integer in \[1, 1073741824\], got '0'"),
    ("HASHATTENTION_SELECTION_RESIDENT_BLOCKS", "many",
     r"HASHATTENTION_SELECTION_RESIDENT_BLOCKS must be an integer in \[1, 1073741824\], got 'many'"),
])
def test_bad_override_values_are_named(monkeypatch, variable, value, message):
    """The selection's environment overrides reject what they cannot mean, naming the variable and
    the values it takes."""
    monkeypatch.setenv(variable, value)
    q_sig = torch.zeros(1, 4, 1, 1, dtype=torch.int32, device="cuda")
    k_sig = torch.zeros(1, 4, 10_000, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=message):
        ha.hamming_topk(q_sig, k_sig, selection_heads=4, sink_tokens=8, local_tokens=8, budget_tokens=100)
