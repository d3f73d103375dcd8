"""What HashAttention does at inference: windows, budget, which rows and layers run sparse.

The budget counts every attended token of a query row, windows included. For a sequence
with ``n`` valid keys (left padding excluded; the current token included) a query row
attends to

* ``budget_tokens = T``: the sink window, the local window and the ``T - sink - local``
  best-scoring other keys, i.e. ``min(n, T)`` tokens in total;
* ``sparsity = s``: ``floor(n / s)`` tokens in total, of which ``sink + local`` are the
  windows and the rest the best-scoring other keys. When ``n / s < sink + local`` the two
  windows alone are attended (``min(n, sink + local)`` tokens): the windows are never cut.
  Example: ``n = 4096, s = 16, sink = local = 128``: 256 tokens, all of them the windows;
  ``n = 32768``: 2048 tokens, 1792 of them chosen by the signatures.
* ``n < dense_below_tokens``: all ``n`` tokens (exact dense attention).

For the trailing sparse prompt rows of a prefill, ``n`` is the length of the whole chunk
(the last row's), so earlier rows of the chunk get the same token count.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

SELECTION_MODES = ("query_head", "kv_group")

#: Upper bound of every token count and index of the config: the ops compute positions, window
#: sizes and budgets in int32 (``sink + local + heavy`` included), so each must fit one.
MAX_TOKENS = 2**31 - 1

KeyCount = TypeVar("KeyCount", int, Tensor)


def heavy_tokens(valid_keys: KeyCount, sparsity: Optional[float], budget_tokens: Optional[int], window_tokens: int,
                 dense_below_tokens: int = 0) -> KeyCount:
    """Signature-selected tokens of a query row whose sequence has ``valid_keys`` keys: the budget rule.

    The row attends to ``total`` tokens, ``budget_tokens`` if given, else ``floor(valid_keys /
    sparsity)`` (exactly one of the two is given); all ``valid_keys`` when there are fewer than
    ``dense_below_tokens``. ``window_tokens`` (sink + local) of them are the windows; the rest,
    never negative, are chosen by the signatures. The windows are never cut: when ``total`` is
    below ``window_tokens`` the windows alone are attended.

    ``valid_keys`` is an ``int`` (host-side: the config, the evaluation's budgets) or an integer
    tensor ``(B,)`` (on the device: :mod:`hashattention.bounds`); the result has its type and dtype.
    Both compute ``floor`` of the float64 quotient, so they agree on every input.
    """
    if isinstance(valid_keys, Tensor):
        if budget_tokens is not None:
            total = torch.full_like(valid_keys, budget_tokens)
        else:
            total = torch.floor(valid_keys.to(torch.float64) / sparsity).to(valid_keys.dtype)
        if dense_below_tokens > 0:
            total = torch.where(valid_keys < dense_below_tokens, valid_keys, total)
        return (total - window_tokens).clamp(min=0)
    total = budget_tokens if budget_tokens is not None else math.floor(valid_keys / sparsity)
    if valid_keys < dense_below_tokens:
        total = valid_keys
    return max(total - window_tokens, 0)


@dataclasses.dataclass(frozen=True)
class HashAttentionConfig:
    """Inference settings of HashAttention (immutable, validated on construction; errors are ``ValueError``).

    Change a field with ``dataclasses.replace(config, sparsity=32)`` (validated again), unpatch and
    patch again.

    Every query row attends to at least one token: ``budget_tokens`` is at least 1, and with
    ``sparsity`` the windows are (``sink_tokens + local_tokens >= 1``), since a sequence of fewer than
    ``sparsity`` keys gets no signature-selected token. Token counts, layer indices and ``bits`` are
    ints (numpy ints accepted; bools and floats are not) up to :data:`MAX_TOKENS`, which the ops'
    int32 index arithmetic bounds.

    Attributes:
        sink_tokens: first tokens of each sequence always attended (paper: 128).
        local_tokens: latest tokens always attended, the current one included (paper: 128).
        budget_tokens: total attended tokens per query row, windows included; at least
            ``max(1, sink_tokens + local_tokens)``. Mutually exclusive with ``sparsity``.
        sparsity: attend ``floor(n / sparsity)`` tokens in total, windows included (see the
            module docstring); a finite number ``> 1``, and then ``sink_tokens + local_tokens >= 1``.
            If neither budget is given, ``sparsity = 16``.
        selection: ``"query_head"`` (each query head selects its own tokens, as the paper)
            or ``"kv_group"`` (the query heads of a KV group share one selection: their
            Hamming scores are summed, and each selected K/V row serves the whole group).
        sparse_prompt_tokens: how many trailing tokens of a multi-token forward (the prompt)
            run sparse; earlier ones run dense (SDPA). Paper: 128 (LongBench), 32 (RULER);
            0 = only generated tokens run sparse. Single-token (decode) steps always run sparse.
        dense_below_tokens: sequences with fewer valid keys than this attend to all of them.
        dense_layers: indices of layers kept dense (SDPA, no signatures in their cache).
        bits: expected signature bits; ``None`` takes the adapters' value, otherwise
            :func:`hashattention.patch` checks that the adapters match.
    """

    sink_tokens: int = 128
    local_tokens: int = 128
    budget_tokens: Optional[int] = None
    sparsity: Optional[float] = None
    selection: str = "query_head"
    sparse_prompt_tokens: int = 128
    dense_below_tokens: int = 0
    dense_layers: Sequence[int] = ()
    bits: Optional[int] = None

    def __post_init__(self):
        for name in ("sink_tokens", "local_tokens", "sparse_prompt_tokens", "dense_below_tokens"):
            self._normalise(name, _checked_int(name, getattr(self, name), minimum=0))
        windows = self.sink_tokens + self.local_tokens
        if windows > MAX_TOKENS:
            raise ValueError(
                f"HashAttentionConfig.sink_tokens + local_tokens must be <= {MAX_TOKENS} (the ops index keys with "
                f"int32), got {self.sink_tokens} + {self.local_tokens}"
            )
        if self.budget_tokens is not None and self.sparsity is not None:
            raise ValueError(
                "HashAttentionConfig: give either budget_tokens or sparsity, not both "
                f"(got budget_tokens={self.budget_tokens!r}, sparsity={self.sparsity!r})"
            )
        if self.budget_tokens is None and self.sparsity is None:
            self._normalise("sparsity", 16.0)
        if self.budget_tokens is not None:
            self._normalise("budget_tokens", _checked_int("budget_tokens", self.budget_tokens, minimum=1))
            if self.budget_tokens < windows:
                raise ValueError(
                    f"HashAttentionConfig.budget_tokens ({self.budget_tokens}) counts the windows too and must be "
                    f">= sink_tokens + local_tokens ({windows})"
                )
        else:
            self._normalise("sparsity", _checked_sparsity(self.sparsity))
            if windows == 0:
                raise ValueError(
                    "HashAttentionConfig.sink_tokens + local_tokens must be >= 1 with sparsity: a sequence of "
                    f"n < sparsity ({self.sparsity:g}) keys gets floor(n / sparsity) = 0 tokens, and only the "
                    "windows guarantee each row one (local_tokens >= 1 keeps the current token); "
                    "or give budget_tokens instead"
                )
        if not isinstance(self.selection, str) or self.selection not in SELECTION_MODES:
            raise ValueError(f"HashAttentionConfig.selection must be one of {SELECTION_MODES}, got {self.selection!r}")
        if isinstance(self.dense_layers, (str, bytes)) or not isinstance(self.dense_layers, Iterable):
            raise ValueError(
                f"HashAttentionConfig.dense_layers must be a sequence of layer indices, got {self.dense_layers!r}"
            )
        layers = {_checked_int("dense_layers entries", layer, minimum=0) for layer in self.dense_layers}
        self._normalise("dense_layers", tuple(sorted(layers)))
        if self.bits is not None:
            self._normalise("bits", _checked_int("bits", self.bits, minimum=32))
            if self.bits % 32:
                raise ValueError(f"HashAttentionConfig.bits must be a multiple of 32, got {self.bits}")

    def _normalise(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen dataclass: fields are set once, here

    @property
    def window_tokens(self) -> int:
        return self.sink_tokens + self.local_tokens

    def heavy_tokens(self, valid_keys: KeyCount) -> KeyCount:
        """Signature-selected tokens per query row for ``valid_keys`` keys (an int or an integer tensor
        ``(B,)``): :func:`heavy_tokens` under this config."""
        return heavy_tokens(valid_keys, self.sparsity, self.budget_tokens, self.window_tokens, self.dense_below_tokens)

    def total_tokens(self, valid_keys: int) -> int:
        """Tokens one query row attends to when its sequence has ``valid_keys`` keys, windows included."""
        return min(valid_keys, self.window_tokens + self.heavy_tokens(valid_keys))

    def heavy_width(self, max_keys: int) -> int:
        """Static number of signature-selected slots for a cache holding up to ``max_keys`` keys.

        It sets the output width of the selection op (``sink + local + heavy_width``), so
        it depends only on shapes, never on device values: per-sequence budgets lower it. The
        widest budget is the full cache's, or, with ``dense_below_tokens``, the largest sequence
        still attended densely (``dense_below_tokens - 1`` keys).
        """
        heavy = heavy_tokens(max_keys, self.sparsity, self.budget_tokens, self.window_tokens)
        if self.dense_below_tokens > 0:
            heavy = max(heavy, self.heavy_tokens(self.dense_below_tokens - 1))
        return min(heavy, max_keys)

    def describe(self) -> str:
        budget = f"{self.budget_tokens} tokens" if self.budget_tokens is not None else f"1/{self.sparsity:g} of the keys"
        return (
            f"budget {budget} (windows included), sink {self.sink_tokens}, local {self.local_tokens}, "
            f"selection per {self.selection.replace('_', ' ')}, last {self.sparse_prompt_tokens} prompt tokens sparse"
            + (f", dense below {self.dense_below_tokens} keys" if self.dense_below_tokens else "")
            + (f", dense layers {list(self.dense_layers)}" if self.dense_layers else "")
        )


def checked_int(label: str, value, minimum: int, maximum: int = MAX_TOKENS) -> int:
    """``value`` as a plain ``int`` if it is an integer (Python or numpy; not a bool, not a float)
    in ``[minimum, maximum]``; otherwise a ValueError naming ``label`` (e.g. ``"HashAttentionConfig.bits"``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{label} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if not minimum <= value <= maximum:
        raise ValueError(f"{label} must be an int in [{minimum}, {maximum}], got {value}")
    return value


def _checked_int(name: str, value, minimum: int) -> int:
    return checked_int(f"HashAttentionConfig.{name}", value, minimum)


def _checked_sparsity(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"HashAttentionConfig.sparsity must be a number > 1, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value <= 1:
        raise ValueError(f"HashAttentionConfig.sparsity must be a finite number > 1, got {value!r}")
    return value


def validate_for_model(config: HashAttentionConfig, num_layers: int) -> Tuple[int, ...]:
    """Check ``dense_layers`` against the model's layer count; returns them."""
    bad = [layer for layer in config.dense_layers if layer >= num_layers]
    if bad:
        raise ValueError(f"HashAttentionConfig.dense_layers {bad} out of range: the model has {num_layers} layers")
    return tuple(config.dense_layers)
