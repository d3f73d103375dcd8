"""The training recipe as one dataclass, loadable from a TOML/JSON file and overridable by flags.

Defaults follow the paper (HashAttention, Desai et al., 2025): 32 bits, a per-head MLP
``head_dim -> 128 -> SiLU -> 128 -> SiLU -> 32``, labels = true top-32 of q·k/√d outside the sink
and local windows, BCE with positive weight ``alpha + beta * n`` (alpha 20, beta 0), Adam lr 1e-3.

Two defaults are scaled for short-context models such as SmolLM2 (sequences of 2K tokens instead of
32K-64K): ``sink_tokens``/``local_tokens`` are 8/8 instead of 128/128, which keeps the windows the same
share of the context (1/128 of n each) so a sparsity budget still leaves room for heavy tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from hashattention.activations import ACTIVATIONS

#: Values of ``TrainConfig.device`` (:mod:`train.distributed` places each process).
DEVICES = ("cpu", "cuda")

#: The checkout this package runs from (train/ is not installed: it runs from a clone).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A small public-domain corpus shipped with the clone, enough for a smoke-test run.
SAMPLE_CORPUS = os.path.join(REPO_ROOT, "train", "sample_corpus")


def default_corpus() -> str:
    """``../shared/corpus`` next to the clone when present (the full training corpus), else :data:`SAMPLE_CORPUS`."""
    shared = os.path.join(os.path.dirname(REPO_ROOT), "shared", "corpus")
    return shared if os.path.isdir(shared) else SAMPLE_CORPUS


@dataclasses.dataclass
class TrainConfig:
    """Every option of the pipeline (``python -m train <cmd> --help`` lists them as flags).

    Paths: ``work_dir`` holds shards, checkpoints and reports; ``output_dir`` receives the
    ``HashAdapters.save_pretrained`` directory.
    """

    # model and data
    model: str = "smollm2"  # "smollm2" (offline GGUF) or a local Hugging Face model directory
    tokenizer: str = "auto"  # "auto" (the model's own) or "bytes" (UTF-8 bytes modulo the vocab; tests)
    dataset: str = "local"  # "local" (text files under corpus) or "openwebtext" (needs network + datasets)
    corpus: str = dataclasses.field(default_factory=default_corpus)
    validation_modulus: int = 10  # a document is held out iff crc32(relative path) % modulus == 0
    document_tokens: int = 8192  # each document contributes at most its first N tokens (0 = all)
    sequence_tokens: int = 2048
    train_sequences: int = 32
    validation_sequences: int = 8
    queries_per_sequence: int = 256
    query_start_fraction: float = 0.5  # queries are sampled among positions >= fraction * sequence_tokens
    # Each sequence runs at positions offset .. offset + sequence_tokens - 1, offset drawn in
    # [0, max_position_offset]: RoPE rotates the captured queries and keys by the offset while their
    # dot products (the labels) stay the same, so short sequences teach signatures for late positions.
    max_position_offset: int = 0
    # Facts stated early in each training sequence and restated in its query window
    # (train/retrieval_facts.py): retrieval-shaped rows for the labels. 0 = prose only.
    retrieval_facts: int = 0
    # "repeat": the restatement repeats the statement word for word; "paraphrase": it says the same
    # fact in other words (one of several statement / paraphrase pairs per fact), so that the labels
    # teach retrieval across wording, as a question about a needle needs; "multivalue": two codes
    # per word, stated apart and restated together (a needle with several values); "frequent": as
    # "repeat", plus lists of words with Zipf-like counts and sentences naming the most frequent;
    # "codes": as "repeat", plus a stream of made-up code words on each side of the query window.
    retrieval_fact_style: str = "repeat"
    shard_dtype: str = "float32"  # storage of captured queries/keys: float32 | bfloat16
    # labels
    top_k: int = 32
    sink_tokens: int = 8
    local_tokens: int = 8
    target: str = "qk"  # "qk" (q·k/√d) or "qk_log_value_norm" (q·k/√d + log‖v‖, the paper's lemma)
    key_heads: str = "query"  # "query" (paper: per query head) or "kv" (group-shared selection)
    # adapters
    bits: int = 32
    hidden_features: Tuple[int, ...] = (128, 128)
    activation: str = "silu"
    # fit
    alpha: float = 20.0
    beta: float = 0.0
    # 0: every positive of a row weighs the same (the paper); m in (0, 1]: a positive's weight is
    # scaled by (1 - m) + m * k * p, p its attention probability renormalised over the row's k
    # positives (mean scale 1), so the keys a query attends to most -- retrieval -- weigh more.
    positive_attention_mix: float = 0.0
    threshold: float = 0.0
    learning_rate: float = 1e-3
    epochs: int = 4
    checkpoint_every: int = 16  # steps between atomic checkpoints
    seed: int = 0
    layers: Optional[Tuple[int, ...]] = None  # train/validate only these layers (default all)
    threads: int = 0  # torch intra-op threads per process (0: leave torch's default)
    # Where collect's model forward and fit run: "cpu", or "cuda" (each torchrun process on the GPU
    # of its LOCAL_RANK, processes joined through NCCL). Validation runs on the CPU either way.
    device: str = "cpu"
    # validation
    sparsities: Tuple[int, ...] = (8, 16, 32)  # budget n/s tokens in total, windows included
    save_dtype: str = "bfloat16"  # dtype of the shipped adapter weights
    # paths
    work_dir: str = "runs/default"
    output_dir: str = ""  # default: <work_dir>/adapters

    def __post_init__(self):
        self._normalise_types()
        self.validate()

    def _normalise_types(self) -> None:
        """Coerce each field to its declared type, refusing values that would change on the way: a
        fractional count (``epochs = 2.5``, ``sparsities = [8.5]``), a non-finite or non-numeric float,
        a boolean where a number is expected. (``int(8.5)`` would silently train with 8.)"""
        for field in dataclasses.fields(self):
            kind, value = str(field.type), getattr(self, field.name)
            if value is None and kind.startswith("Optional"):
                continue
            if "Tuple" in kind:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise ValueError(f"TrainConfig.{field.name} must be a list of integers, got {value!r}")
                setattr(self, field.name, tuple(_integer(field.name, v) for v in value))
            elif kind == "int":
                setattr(self, field.name, _integer(field.name, value))
            elif kind == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"TrainConfig.{field.name} must be a finite number, got {value!r}")
                setattr(self, field.name, float(value))
            elif not isinstance(value, str):
                raise ValueError(f"TrainConfig.{field.name} must be a string, got {value!r}")

    def validate(self) -> None:
        positive = ("sequence_tokens", "queries_per_sequence", "top_k", "bits", "epochs", "checkpoint_every",
                    "validation_modulus")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("train_sequences", "validation_sequences", "sink_tokens", "local_tokens", "threads",
                     "document_tokens", "max_position_offset", "retrieval_facts"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.query_start_fraction < 1.0:
            raise ValueError(f"TrainConfig.query_start_fraction must be in [0, 1), got {self.query_start_fraction}")
        first_query = self.first_query_position
        if first_query >= self.sequence_tokens or self.sequence_tokens - first_query < self.queries_per_sequence:
            raise ValueError(
                f"TrainConfig: {self.queries_per_sequence} queries per sequence do not fit in positions "
                f"[{first_query}, {self.sequence_tokens}) (raise sequence_tokens or lower queries_per_sequence)"
            )
        choices = {"tokenizer": ("auto", "bytes"), "target": ("qk", "qk_log_value_norm"), "key_heads": ("query", "kv"),
                   "dataset": ("local", "openwebtext"), "shard_dtype": ("float32", "bfloat16"),
                   "save_dtype": ("float32", "bfloat16", "float16"), "activation": ACTIVATIONS, "device": DEVICES,
                   "retrieval_fact_style": ("repeat", "paraphrase", "multivalue", "frequent", "codes")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.retrieval_fact_style == "frequent" and 0 < self.retrieval_facts < 3:
            raise ValueError("TrainConfig.retrieval_facts must be 0 or >= 3 with retrieval_fact_style = \"frequent\" "
                             f"(its sentences name the three most frequent listed words), got {self.retrieval_facts}")
        if self.bits % 32:
            raise ValueError(f"TrainConfig.bits must be a multiple of 32, got {self.bits}")
        if any(h < 1 for h in self.hidden_features):
            raise ValueError(f"TrainConfig.hidden_features must be positive widths, got {list(self.hidden_features)}")
        if not self.sparsities or any(s < 1 for s in self.sparsities):
            raise ValueError(f"TrainConfig.sparsities must be integers >= 1, got {list(self.sparsities)}")
        if self.layers is not None:
            if not self.layers or any(layer < 0 for layer in self.layers) or len(set(self.layers)) != len(self.layers):
                raise ValueError(f"TrainConfig.layers must be distinct layer indices >= 0, got {list(self.layers)}")
        if not 0.0 <= self.positive_attention_mix <= 1.0:
            raise ValueError(f"TrainConfig.positive_attention_mix must be in [0, 1], got {self.positive_attention_mix}")
        if self.alpha < 0 or self.beta < 0 or self.alpha + self.beta == 0:
            # the weight of a positive cell, alpha + beta * n, must be positive for every n >= 1
            raise ValueError(f"TrainConfig.alpha and beta must be >= 0 and not both 0, got {self.alpha} and {self.beta}")
        if self.learning_rate <= 0:
            raise ValueError(f"TrainConfig.learning_rate must be > 0, got {self.learning_rate}")

    def selected_layers(self, num_layers: int) -> List[int]:
        """The layers to train or validate in a model of ``num_layers``: ``layers``, or all of them.

        Raises a ValueError naming the first index that is not a layer of the model."""
        if self.layers is None:
            return list(range(num_layers))
        for layer in self.layers:
            if layer >= num_layers:
                raise ValueError(f"TrainConfig.layers: {layer} is not a layer of the model (0..{num_layers - 1})")
        return list(self.layers)

    @property
    def first_query_position(self) -> int:
        """Queries need eligible keys outside the windows: at least top_k of them."""
        floor = self.sink_tokens + self.local_tokens + self.top_k
        return max(floor, int(self.query_start_fraction * self.sequence_tokens))

    @property
    def adapters_dir(self) -> str:
        return self.output_dir or os.path.join(self.work_dir, "adapters")

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        for key, value in d.items():
            if isinstance(value, tuple):
                d[key] = list(value)
        return d

    # -- files and flags -------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str) -> Dict[str, Any]:
        """Read a ``.toml`` or ``.json`` file into a dict of field values (unknown keys are errors)."""
        if path.endswith(".toml"):
            import tomllib

            with open(path, "rb") as f:
                values = tomllib.load(f)
        elif path.endswith(".json"):
            with open(path) as f:
                values = json.load(f)
        else:
            raise ValueError(f"config file {path!r} must end in .toml or .json")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"config file {path!r} has unknown keys {unknown}; known: {sorted(known)}")
        return values



def _integer(name: str, value: Any) -> int:
    """``value`` as an int; a ValueError naming the field when it is not a whole number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"TrainConfig.{name} must be a whole number, got {value!r}")
    return int(value)


def setting_differences(recorded: Mapping[str, Any], current: Mapping[str, Any], recorded_as: str,
                        current_as: str) -> List[str]:
    """``"name: <recorded_as> R, <current_as> C"`` for every setting of ``current`` whose value differs
    from the one in ``recorded`` (compared as JSON, so that a tuple equals its list and 1e-3 equals 0.001)."""
    def as_json(value):
        return json.loads(json.dumps(value))

    missing = object()
    differences = []
    for name, value in current.items():
        before = recorded.get(name, missing)
        if before is missing:
            differences.append(f"{name}: {recorded_as} not recorded, {current_as} {as_json(value)!r}")
        elif as_json(before) != as_json(value):
            differences.append(f"{name}: {recorded_as} {as_json(before)!r}, {current_as} {as_json(value)!r}")
    return differences

HELP = {
    "model": '"smollm2" (the offline GGUF model) or a local Hugging Face model directory',
    "tokenizer": '"auto" (the model\'s own) or "bytes" (UTF-8 bytes modulo the vocabulary, for test models)',
    "dataset": '"local" (text files under --corpus) or "openwebtext" (online, needs the datasets package)',
    "corpus": "folder of .txt files (default: ../shared/corpus next to the clone, else train/sample_corpus)",
    "validation_modulus": "a document is held out iff crc32(relative path) %% modulus == 0",
    "document_tokens": "each document contributes at most its first N tokens (0 = all)",
    "sequence_tokens": "tokens per sequence (documents are concatenated, EOS between them)",
    "train_sequences": "training sequences to collect",
    "validation_sequences": "held-out sequences to collect",
    "queries_per_sequence": "query positions sampled per sequence",
    "query_start_fraction": "queries are sampled among positions >= fraction * sequence_tokens",
    "shard_dtype": "storage dtype of captured queries/keys: float32 or bfloat16",
    "max_position_offset": "run each sequence at a random position offset in [0, N] (RoPE augmentation: "
                           "adapters that work beyond sequence_tokens)",
    "retrieval_facts": "facts written early into each training sequence and restated in its query window "
                       "(retrieval-shaped label rows; 0 = prose only)",
    "retrieval_fact_style": '"repeat" (restated word for word), "paraphrase" (restated in other words), '
                            '"multivalue" (two codes per word, restated together) or "frequent" (as "repeat", plus word '
                            'lists with Zipf-like counts, the most frequent named in the query window) or "codes" (as "repeat", plus '
                            'streams of made-up code words before and inside the query window)',
    "top_k": "labels: the true top-k keys by the target score",
    "sink_tokens": "sink window (first tokens), excluded from labels and always selected",
    "local_tokens": "local window (latest tokens), excluded from labels and always selected",
    "target": '"qk" (q.k/sqrt(d)) or "qk_log_value_norm" (q.k/sqrt(d) + log||v||)',
    "key_heads": '"query" (one key MLP per query head, the paper) or "kv" (per KV head, group-shared selection)',
    "bits": "signature bits (multiple of 32)",
    "hidden_features": "hidden layer widths of each MLP",
    "activation": "activation between MLP layers (silu, relu, gelu, tanh, identity)",
    "alpha": "positive weight = alpha + beta * n (n = keys the query sees)",
    "beta": "positive weight = alpha + beta * n",
    "positive_attention_mix": "m in [0, 1]: scale each positive's weight by (1 - m) + m*k*p, p = its attention "
                              "probability renormalised over the row's k positives (0: uniform, the paper)",
    "threshold": "subtracted from tanh(f_q)·tanh(f_k) before the sigmoid",
    "learning_rate": "Adam learning rate",
    "epochs": "passes over the training sequences per layer",
    "checkpoint_every": "optimizer steps between atomic checkpoints",
    "seed": "seed of initialisation, data order, query sampling and LSH projections",
    "layers": "train/validate only these layers (default: all)",
    "threads": "torch intra-op threads per process (0: torch's default)",
    "device": '"cpu" or "cuda" (collect and fit on the GPU of each process\'s LOCAL_RANK; NCCL between processes)',
    "sparsities": "validation budgets n/s (tokens in total, windows included)",
    "save_dtype": "dtype of the written adapter weights: bfloat16, float16 or float32",
    "work_dir": "shards, checkpoints, per-layer weights and validation reports",
    "output_dir": "where the adapters are saved (default: <work_dir>/adapters)",
}


def _field_type(field: dataclasses.Field) -> str:
    return str(field.type)


def add_config_arguments(parser) -> None:
    """One ``--flag`` per :class:`TrainConfig` field (dashes for underscores), all defaulting to None so
    that only flags given on the command line override the config file."""
    parser.add_argument("--config", help="TOML or JSON file of TrainConfig fields; flags override it")
    defaults = TrainConfig.__new__(TrainConfig)  # field defaults without running validation
    for field in dataclasses.fields(TrainConfig):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        flag = "--" + field.name.replace("_", "-")
        kind = _field_type(field)
        help_text = f"{HELP.get(field.name, '')} (default: {default!r})".strip()
        if "Tuple" in kind:
            element = float if "float" in kind else int
            parser.add_argument(flag, type=element, nargs="+", default=None, help=help_text)
        elif kind in ("int",):
            parser.add_argument(flag, type=int, default=None, help=help_text)
        elif kind in ("float",):
            parser.add_argument(flag, type=float, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=str, default=None, help=help_text)
    del defaults


def config_from_arguments(args) -> TrainConfig:
    """Defaults < config file < flags."""
    values: Dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(TrainConfig.from_file(args.config))
    for field in dataclasses.fields(TrainConfig):
        value = getattr(args, field.name, None)
        if value is not None:
            values[field.name] = value
    return TrainConfig(**values)
