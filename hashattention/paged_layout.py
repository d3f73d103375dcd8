"""Index arithmetic between transformers' packed continuous-batching batch and the ops' paged layout.

transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, ``transformers
serve --continuous-batching``) runs one forward over a packed batch: the query rows of ``R``
requests concatenated into ``T`` rows (``(1, H, T, D)``), ``cu_seq_lens_q`` int32 ``(R + 1,)``
their offsets; ``cu_seq_lens_k`` int32 ``(R + 1,)`` the offsets of each request's keys (cached and
new) in ``read_index``, int64, one physical cache slot per key in position order; ``write_index``
int64 ``(T,)`` the slots the new keys go to. A slot is ``block * block_size + offset``, and a
request's key at position ``p`` sits in slot ``blocks[p // block_size] * block_size + p %
block_size`` of its own blocks (``FullAttentionCacheAllocator``).

:func:`hashattention.ops.sparse_attention` reads the K/V pages in place through a block table
int32 ``(R, max_blocks)``; :func:`hashattention.ops.hamming_topk` takes the key signatures of
each request as one ``(R, Hk, N, W)`` tensor. The functions below turn the former into the latter
with device tensor arithmetic only: every shape comes from host integers transformers passes
(``max_seqlen_q``, ``max_seqlen_k``, tensor sizes), never from a device value, so nothing is read
back to the host.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def request_lengths(cu_seq_lens: Tensor) -> Tensor:
    """int32 ``(R,)`` per-request lengths from cumulative offsets ``(R + 1,)``."""
    return (cu_seq_lens[1:] - cu_seq_lens[:-1]).to(torch.int32)


def request_slots(read_index: Tensor, write_index: Tensor) -> Tensor:
    """The slots of every request's keys in position order, indexed by ``cu_seq_lens_k``.

    A batch whose requests are all fresh prompts reads nothing from the cache (``read_index`` is
    empty); its keys are then exactly the new ones, in ``write_index`` order, and ``cu_seq_lens_k``
    equals ``cu_seq_lens_q``.
    """
    return read_index if read_index.numel() > 0 else write_index


def block_table(slots: Tensor, cu_seq_lens_k: Tensor, block_size: int, max_keys: int) -> Tensor:
    """int32 ``(R, ceil(max_keys / block_size))``: entry ``[r, j]`` is the block holding positions
    ``j * block_size ..`` of request ``r``.

    Args:
        slots: int64 ``(S,)`` from :func:`request_slots`.
        cu_seq_lens_k: int32 ``(R + 1,)`` offsets of each request in ``slots``.
        block_size: tokens per block of the paged cache.
        max_keys: the longest request's key count (``max_seqlen_k``, a host int).

    Entries past a request's own keys hold some other valid block; the ops never address them
    (positions are below the request's length).
    """
    blocks = max(1, -(-max_keys // block_size))
    first = cu_seq_lens_k[:-1].to(torch.int64)
    offsets = torch.arange(blocks, device=slots.device, dtype=torch.int64) * block_size
    where = (first[:, None] + offsets[None, :]).clamp(max=slots.numel() - 1)
    return torch.div(slots[where], block_size, rounding_mode="floor").to(torch.int32)


def position_slots(table: Tensor, block_size: int, max_keys: int) -> Tensor:
    """int64 ``(R, max_keys)``: the slot of each request's key position through its block table."""
    positions = torch.arange(max_keys, device=table.device, dtype=torch.int64)
    blocks = table.to(torch.int64)[:, positions // block_size]
    return blocks * block_size + positions % block_size


def sparse_rows(
    cu_seq_lens_q: Tensor,
    rows_per_request: int,
    total_rows: int,
    sparse_prompt_tokens: int,
    final_chunk: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """Which packed query rows run sparse, laid out ``(R, L)`` for the ops.

    A request's sparse rows are the last rows of its chunk: 1 for a decode step (one row), the
    last ``min(sparse_prompt_tokens, rows)`` of a prompt chunk that ends the prompt
    (``final_chunk``), none for an earlier chunk of a prompt split over several batches. Row ``l``
    of request ``r`` is packed row ``cu_seq_lens_q[r + 1] - L + l``, at position ``length - L + l``
    as :func:`hashattention.ops.hamming_topk` numbers a chunk's rows.

    Args:
        cu_seq_lens_q: int32 ``(R + 1,)``.
        rows_per_request: ``L`` (host int), at least every request's sparse row count.
        total_rows: ``T``, the packed rows.
        sparse_prompt_tokens: :attr:`HashAttentionConfig.sparse_prompt_tokens`.
        final_chunk: bool ``(R,)``: the chunk ends its prompt or is a decode step (None: all do).

    Returns:
        ``(rows, valid)``: int64 ``(R, L)`` packed row indices (clamped into ``[0, T)``) and bool
        ``(R, L)``, False for the padding rows of a request with fewer than ``L`` sparse rows.
    """
    query_lengths = request_lengths(cu_seq_lens_q)
    count = torch.where(query_lengths == 1, 1, query_lengths.clamp(max=sparse_prompt_tokens))
    if final_chunk is not None:
        count = torch.where(final_chunk, count, 0)
    count = count.clamp(max=rows_per_request)
    row = torch.arange(rows_per_request, device=cu_seq_lens_q.device, dtype=torch.int64)
    rows = cu_seq_lens_q[1:, None].to(torch.int64) - rows_per_request + row[None, :]
    valid = row[None, :] >= (rows_per_request - count)[:, None]
    return rows.clamp(0, total_rows - 1), valid


def final_chunks(cu_seq_lens_q: Tensor, logits_indices: Optional[Tensor]) -> Optional[Tensor]:
    """bool ``(R,)``: the request's last row is one whose logits are kept (its chunk ends the
    prompt, or is a decode step); None without ``logits_indices``."""
    if logits_indices is None:
        return None
    last_rows = cu_seq_lens_q[1:] - 1
    has_rows = cu_seq_lens_q[1:] > cu_seq_lens_q[:-1]
    return torch.isin(last_rows, logits_indices.to(last_rows.dtype)) & has_rows


def packed_causal_mask(cu_seq_lens_q: Tensor, cu_seq_lens_k: Tensor, total_rows: int, total_keys: int) -> Tensor:
    """bool ``(1, 1, T, K)``: packed row ``t`` of request ``r`` sees request ``r``'s keys up to its own position.

    The keys are laid out as ``read_index`` orders them (request ``r``: columns ``cu_seq_lens_k[r] ..
    cu_seq_lens_k[r + 1] - 1``). Rows past the last request (padding a batch to a fixed size) see
    column 0 only, so that they stay finite.
    """
    device = cu_seq_lens_q.device
    rows = torch.arange(total_rows, device=device, dtype=cu_seq_lens_q.dtype)
    requests = cu_seq_lens_q.numel() - 1
    request = torch.searchsorted(cu_seq_lens_q[1:], rows, right=True).clamp(max=requests - 1)
    first = cu_seq_lens_k[request]
    # Row t is the (t - cu_q[r])-th of the chunk; the chunk's last row sees up to cu_k[r + 1] - 1.
    last = cu_seq_lens_k[request + 1] - cu_seq_lens_q[request + 1] + rows
    columns = torch.arange(total_keys, device=device, dtype=cu_seq_lens_k.dtype)
    mask = (columns[None, :] >= first[:, None]) & (columns[None, :] <= last[:, None])
    padding = (rows >= cu_seq_lens_q[-1])[:, None] & (columns == 0)[None, :]
    return (mask | padding)[None, None]
