"""Learned signature adapters: per-layer, per-head query and key MLPs, batched across heads.

Each attention layer has two :class:`HeadwiseMLP` stacks, one for queries (one MLP per query
head) and one for keys (one MLP per query head, as in the paper, or one per KV head for the
group-shared mode). Weights are stored as ``(heads, in_features, out_features)`` stacks so a
whole layer runs as one batched product, in training (float, differentiable, :meth:`forward`)
and at inference (packed int32 signatures through ``torch.ops.hashattention.encode_signatures``,
or ``encode_signatures_pair`` for a decode step's queries and new keys together).

Files: ``save_pretrained(dir)`` writes ``adapters.safetensors`` (tensors only, no pickle) and
``adapter_config.json`` (architecture, the model it was trained for, training recipe, validation
recall and the weights file's SHA-256); ``from_pretrained(dir)`` reads them back and verifies the
checksum. Adapters shipped inside the package
(``hashattention/pretrained/<name>/``) load by name: ``HashAdapters.from_pretrained("smollm2-135m-instruct")``
(:func:`pretrained_names`, :func:`pretrained_path`). :func:`convert_authors_checkpoint` reads the
authors' released ``.pt`` patches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pickle
import re
import tempfile
from collections.abc import Iterable
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import ops
from .activations import ACTIVATION_FUNCTIONS, ACTIVATIONS
from .config import checked_int

WEIGHTS_NAME = "adapters.safetensors"
CONFIG_NAME = "adapter_config.json"
FORMAT_VERSION = 1
#: Key of ``adapter_config.json`` holding the SHA-256 (hex) of ``adapters.safetensors``.
CHECKSUM_KEY = "weights_sha256"
#: Where the package keeps its shipped adapters, one directory per name.
PRETRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrained")


def pretrained_names() -> List[str]:
    """Names of the adapters shipped with the package (sorted), e.g. ``["smollm2-135m-instruct"]``."""
    if not os.path.isdir(PRETRAINED_DIR):
        return []
    return sorted(name for name in os.listdir(PRETRAINED_DIR)
                  if os.path.isfile(os.path.join(PRETRAINED_DIR, name, CONFIG_NAME)))


def pretrained_path(name: str) -> str:
    """Directory of the shipped adapters ``name``; a ValueError lists the shipped names otherwise."""
    if name not in pretrained_names():
        raise ValueError(f"no adapters named {name!r} are shipped with hashattention; shipped: {pretrained_names()}")
    return os.path.join(PRETRAINED_DIR, name)


@dataclasses.dataclass
class AdapterConfig:
    """Architecture and provenance of a set of adapters.

    Attributes:
        num_layers: attention layers of the model.
        num_query_heads, num_kv_heads, head_dim: the model's attention layout.
        key_heads: ``"query"`` (one key MLP per query head, keys repeated over the KV group,
            as in the paper) or ``"kv"`` (one per KV head; group-shared selection).
        bits: signature bits (a multiple of 32).
        hidden_features: widths of the hidden layers (paper: ``(128, 128)``).
        activation: between layers (``silu`` in the paper).
        model: name or path of the model the adapters were trained for.
        training: the recipe used (free-form, recorded for provenance).
        validation: measured recall (free-form, e.g. ``{"recall@16x": 0.85}``).
    """

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    key_heads: str = "query"
    bits: int = 32
    hidden_features: Sequence[int] = (128, 128)
    activation: str = "silu"
    model: str = ""
    training: Dict[str, Any] = dataclasses.field(default_factory=dict)
    validation: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "bits"):
            setattr(self, name, checked_int(f"AdapterConfig.{name}", getattr(self, name), minimum=1))
        if isinstance(self.hidden_features, (str, bytes)) or not isinstance(self.hidden_features, Iterable):
            raise ValueError(f"AdapterConfig.hidden_features must be a sequence of widths, got {self.hidden_features!r}")
        self.hidden_features = tuple(
            checked_int("AdapterConfig.hidden_features entries", width, minimum=1) for width in self.hidden_features
        )
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"AdapterConfig.num_kv_heads ({self.num_kv_heads}) must divide num_query_heads ({self.num_query_heads})"
            )
        if self.key_heads not in ("query", "kv"):
            raise ValueError(f"AdapterConfig.key_heads must be 'query' or 'kv', got {self.key_heads!r}")
        if self.bits % 32:
            raise ValueError(f"AdapterConfig.bits must be a multiple of 32, got {self.bits}")
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise ValueError(f"AdapterConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def num_key_signature_heads(self) -> int:
        return self.num_query_heads if self.key_heads == "query" else self.num_kv_heads

    @property
    def words(self) -> int:
        return self.bits // 32

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["hidden_features"] = list(self.hidden_features)
        return d


class HeadwiseMLP(nn.Module):
    """``heads`` independent MLPs ``in_features -> hidden... -> out_features``.

    Parameters ``weights.{i}``: ``(heads, in, out)`` and ``biases.{i}``: ``(heads, out)``,
    initialised like ``nn.Linear``.
    """

    def __init__(self, heads: int, in_features: int, hidden_features: Sequence[int], out_features: int,
                 activation: str = "silu"):
        super().__init__()
        self.activation = activation
        sizes = [in_features, *hidden_features, out_features]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / math.sqrt(fan_in)
            self.weights.append(nn.Parameter(torch.empty(heads, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(heads, fan_out).uniform_(-bound, bound)))

    def forward(self, x: Tensor) -> Tensor:
        """Pre-sign outputs ``(B, heads, N, out)`` from ``x`` ``(B, heads, N, in)``; differentiable."""
        h = x
        act = ACTIVATION_FUNCTIONS[self.activation]
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = torch.matmul(h, w.to(h.dtype)) + b.to(h.dtype)[None, :, None, :]
            if i + 1 < len(self.weights):
                h = act(h)
        return h

    def signatures(self, x: Tensor) -> Tensor:
        """Packed int32 signatures ``(B, heads, N, out // 32)`` through the encode op."""
        weights, biases = self.op_parameters()
        return ops.encode_signatures(x, weights, biases, self.activation)

    def op_parameters(self) -> Tuple[List[Tensor], List[Tensor]]:
        """``(weights, biases)`` as the encode ops take them. The ops read float32, float16 and
        bfloat16 weights; float64 ones (e.g. after ``adapters.double()``) are passed as float32,
        the precision the ops compute in."""
        return _op_dtype(self.weights), _op_dtype(self.biases)


class LayerAdapter(nn.Module):
    """The query and key MLPs of one attention layer."""

    def __init__(self, config: AdapterConfig):
        super().__init__()
        self.config = config
        args = (config.head_dim, config.hidden_features, config.bits, config.activation)
        self.query = HeadwiseMLP(config.num_query_heads, *args)
        self.key = HeadwiseMLP(config.num_key_signature_heads, *args)

    def expand_keys(self, key: Tensor) -> Tensor:
        """KV-head keys ``(B, Hkv, N, D)`` -> one key per key-signature head."""
        if self.config.key_heads == "kv":
            return key
        return key.repeat_interleave(self.config.num_query_heads // self.config.num_kv_heads, dim=1)

    def query_signatures(self, query: Tensor) -> Tensor:
        """int32 ``(B, Hq, L, W)`` from post-RoPE queries ``(B, Hq, L, D)``."""
        return self.query.signatures(query)

    def key_signatures(self, key: Tensor) -> Tensor:
        """int32 ``(B, Hk, N, W)`` from post-RoPE keys ``(B, Hkv, N, D)``."""
        return self.key.signatures(self.expand_keys(key))

    def decode_signatures(self, query: Tensor, key: Tensor) -> Tuple[Tensor, Tensor]:
        """``(query_signatures, key_signatures)`` of a decode step in one op call (one CUDA launch).

        Args:
            query: post-RoPE queries ``(B, Hq, L, D)``.
            key: post-RoPE keys ``(B, Hkv, N, D)`` (e.g. the keys a cache layer just appended),
                read per KV head: no repeated copy for per-query-head key MLPs.

        Returns:
            int32 ``(B, Hq, L, W)`` and int32 ``(B, Hk, N, W)``, equal to
            :meth:`query_signatures` and :meth:`key_signatures`.
        """
        query_stack, key_stack = self._stacks()
        return ops.encode_signatures_pair(query, *query_stack, key, *key_stack, self.config.activation)

    def _stacks(self):
        """``((query weights, biases), (key weights, biases))`` as the pair ops take them (both
        stacks were built with ``config.activation``)."""
        return self.query.op_parameters(), self.key.op_parameters()

    def decode_signatures_into(self, query: Tensor, key: Tensor, key_signatures: Tensor, positions: Tensor) -> Tensor:
        """:meth:`decode_signatures` with the keys' signatures stored into a signature cache.

        Args:
            query: post-RoPE queries ``(B, Hq, L, D)``.
            key: post-RoPE keys ``(B, Hkv, N, D)`` just appended to the cache.
            key_signatures: int32 ``(B, Hk, S, W)`` cache; rows ``positions`` are written in place.
            positions: int64 ``(N,)`` the keys' cache slots (distinct, in ``[0, S)``).

        Returns:
            int32 ``(B, Hq, L, W)``, equal to :meth:`query_signatures`.
        """
        query_stack, key_stack = self._stacks()
        return ops.encode_signatures_pair_into(
            query, *query_stack, key, *key_stack, key_signatures, positions, self.config.activation
        )

    def select_with_new_keys(
        self, query: Tensor, key: Tensor, key_signatures: Tensor, positions: Tensor, **selection
    ) -> Tuple[Tensor, Tensor]:
        """:meth:`decode_signatures_into`, then :func:`hashattention.ops.hamming_topk` on the query
        signatures, in one op call (:func:`hashattention.ops.encode_pair_and_select`).

        Args:
            query, key, key_signatures, positions: as in :meth:`decode_signatures_into`.
            selection: the keyword arguments of :func:`hashattention.ops.hamming_topk` after the
                signatures (``selection_heads``, ``sink_tokens``, ..., ``budgets``).

        Returns:
            ``(indices, counts)``: int32 ``(B, Hs, L, K)`` and ``(B, Hs, L)``.
        """
        query_stack, key_stack = self._stacks()
        indices, counts, _ = ops.encode_pair_and_select(
            query, *query_stack, key, *key_stack, key_signatures, positions, activation=self.config.activation,
            **selection,
        )
        return indices, counts


class HashAdapters(nn.Module):
    """All layers' adapters plus their :class:`AdapterConfig`."""

    def __init__(self, config: AdapterConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(LayerAdapter(config) for _ in range(config.num_layers))

    def __getitem__(self, layer: int) -> LayerAdapter:
        return self.layers[layer]

    @classmethod
    def for_model_config(cls, model_config, key_heads: str = "query", **overrides) -> "HashAdapters":
        """Adapters shaped for a Hugging Face model config (Llama / Mistral style attributes)."""
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        config = AdapterConfig(
            num_layers=model_config.num_hidden_layers,
            num_query_heads=heads,
            num_kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            key_heads=key_heads,
            model=getattr(model_config, "_name_or_path", "") or "",
            **overrides,
        )
        return cls(config)

    def save_pretrained(self, directory: str) -> None:
        """Write ``adapters.safetensors`` and ``adapter_config.json`` into ``directory`` (atomically).

        The JSON records the weights file's SHA-256 (``weights_sha256``), which
        :meth:`from_pretrained` verifies. Weights are stored in their current dtype.
        """
        from safetensors.torch import save

        os.makedirs(directory, exist_ok=True)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        payload = save(tensors, {"format_version": str(FORMAT_VERSION)})
        _atomic_write(os.path.join(directory, WEIGHTS_NAME), lambda path: _write_bytes(path, payload))
        record = {"format_version": FORMAT_VERSION, CHECKSUM_KEY: hashlib.sha256(payload).hexdigest(),
                  **self.config.to_dict()}
        text = json.dumps(record, indent=2, sort_keys=True)
        _atomic_write(os.path.join(directory, CONFIG_NAME), lambda path: _write_bytes(path, (text + "\n").encode()))

    @classmethod
    def from_pretrained(cls, directory: str, device=None, dtype: Optional[torch.dtype] = None) -> "HashAdapters":
        """Load adapters written by :meth:`save_pretrained` into ``directory``, or shipped with the package
        under that name (:func:`pretrained_names`; an existing directory of the same name wins).

        Args:
            directory: a directory path or a shipped name, e.g. ``"smollm2-135m-instruct"``.
            device, dtype: where and in which dtype to put the weights (default: CPU, as stored).

        Raises:
            FileNotFoundError: a file is missing.
            ValueError: naming the file, when the JSON or the safetensors file cannot be read, when the
                weights' SHA-256 differs from the recorded ``weights_sha256`` (a corrupted or replaced
                file; files written before the checksum existed have none and load unchecked), or when
                the weights do not fit the recorded architecture.
        """
        from safetensors.torch import load

        if not os.path.isdir(directory) and directory in pretrained_names():
            directory = pretrained_path(directory)
        config_path = os.path.join(directory, CONFIG_NAME)
        weights_path = os.path.join(directory, WEIGHTS_NAME)
        for path in (config_path, weights_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found: not an adapter directory written by save_pretrained "
                                        f"nor the name of shipped adapters ({', '.join(pretrained_names())})")
        raw = read_adapter_record(config_path)
        with open(weights_path, "rb") as f:
            payload = f.read()
        expected = raw.pop(CHECKSUM_KEY, None)
        if expected is not None:
            actual = hashlib.sha256(payload).hexdigest()
            if actual != expected:
                raise ValueError(
                    f"{weights_path} is corrupted or was replaced: its SHA-256 is {actual}, {config_path} records "
                    f"{CHECKSUM_KEY} = {expected}"
                )
        known = {f.name for f in dataclasses.fields(AdapterConfig)}
        try:
            adapters = cls(AdapterConfig(**{k: v for k, v in raw.items() if k in known}))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{config_path}: {error}") from error
        try:
            state = load(payload)
        except Exception as error:  # safetensors raises its own SafetensorError (and OverflowError, ...)
            raise ValueError(f"{weights_path} is not a readable safetensors file: {error}") from error
        try:
            missing, unexpected = adapters.load_state_dict(state, strict=False)
        except RuntimeError as error:  # shape mismatches
            raise ValueError(f"{weights_path} does not match {config_path}: {error}") from error
        if missing or unexpected:
            raise ValueError(f"{weights_path} does not match {config_path}: missing {missing}, unexpected {unexpected}")
        return adapters.to(device=device, dtype=dtype)


def read_adapter_record(config_path: str) -> Dict[str, Any]:
    """The JSON object of an ``adapter_config.json``, its ``format_version`` checked and removed;
    a ValueError naming the file when it is not valid JSON or of another format version."""
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
    version = raw.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"{config_path}: unsupported format_version {version!r} (expected {FORMAT_VERSION})")
    return raw


def weights_checksum(directory: str) -> str:
    """SHA-256 (hex) of ``directory``'s ``adapters.safetensors``, as :meth:`HashAdapters.save_pretrained`
    records it in ``adapter_config.json`` under ``weights_sha256``."""
    with open(os.path.join(directory, WEIGHTS_NAME), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


_AUTHORS_KEY = re.compile(r"^(\d+)\.learning_to_hash_transformation_([qk])\.(\d+)\.(\d+)\.(weight|bias)$")


def convert_authors_checkpoint(path_or_state: Any, num_kv_heads: int, model: str = "") -> HashAdapters:
    """Convert the authors' released patch (``{L}.learning_to_hash_transformation_{q|k}.{head}.{0|2|4}.{weight|bias}``,
    ``nn.Linear`` weights ``[out, in]``, SiLU between layers, keys per query head) into :class:`HashAdapters`.

    Args:
        path_or_state: a ``.pt`` file (loaded with ``weights_only=True``) or its state dict.
        num_kv_heads: the model's KV heads (the file does not record it).
        model: recorded in the config.
    """
    state = path_or_state
    if not isinstance(state, dict):
        try:
            state = torch.load(path_or_state, map_location="cpu", weights_only=True)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
            if isinstance(error, FileNotFoundError):
                raise
            raise ValueError(f"{path_or_state}: not a readable torch checkpoint: {error}") from error
        if not isinstance(state, dict):
            raise ValueError(f"{path_or_state} must hold a state dict, got {type(state).__name__}")
    entries: Dict[tuple, Tensor] = {}
    for name, tensor in state.items():
        match = _AUTHORS_KEY.match(name)
        if match is None:
            raise ValueError(f"unexpected key {name!r} in the authors' checkpoint")
        layer, side, head, linear, kind = match.groups()
        entries[(int(layer), side, int(head), int(linear), kind)] = tensor
    if not entries:
        raise ValueError("the authors' checkpoint holds no learning_to_hash_transformation tensors")
    layers = sorted({k[0] for k in entries})
    heads = sorted({k[2] for k in entries})
    linears = sorted({k[3] for k in entries})
    if layers != list(range(len(layers))) or heads != list(range(len(heads))):
        raise ValueError("the authors' checkpoint has gaps in its layer or head numbering")
    first = entries[(0, "q", 0, linears[0], "weight")]
    sizes = [first.shape[1]] + [entries[(0, "q", 0, i, "weight")].shape[0] for i in linears]
    config = AdapterConfig(
        num_layers=len(layers),
        num_query_heads=len(heads),
        num_kv_heads=num_kv_heads,
        head_dim=sizes[0],
        key_heads="query",
        bits=sizes[-1],
        hidden_features=tuple(sizes[1:-1]),
        activation="silu",
        model=model,
        training={"source": "converted from the authors' checkpoint"},
    )
    adapters = HashAdapters(config)
    with torch.no_grad():
        for layer in layers:
            for side, mlp in (("q", adapters[layer].query), ("k", adapters[layer].key)):
                for i, linear in enumerate(linears):
                    w = torch.stack([entries[(layer, side, h, linear, "weight")].float().t() for h in heads])
                    b = torch.stack([entries[(layer, side, h, linear, "bias")].float() for h in heads])
                    mlp.weights[i].copy_(w)
                    mlp.biases[i].copy_(b)
    return adapters


def _op_dtype(parameters) -> List[Tensor]:
    return [p.float() if p.dtype == torch.float64 else p for p in parameters]


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _atomic_write(path: str, write) -> None:
    """Write through a temporary file in the same directory, then rename: never a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual permissions of a new file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
