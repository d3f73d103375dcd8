"""The evaluation loop: every selector x sparsity x context on NLL text and RULER-style tasks.

Per sample, the part of the sequence that runs dense is prefilled once (with the selectors
that keep statistics of dense rows watching, e.g. H2O) and its KV cache copied for each
(selector, sparsity) job, so the expensive prefill is shared. Jobs:

* **nll**: held-out text of ``context`` tokens; the last ``nll_tokens`` predictions are made by
  rows that run sparse (one chunk, teacher forcing -- identical to decoding them one by one,
  since each row only attends to earlier positions); recall@k and attention mass are recorded
  at those rows, per layer.
* **task**: a RULER-style prompt of ``context`` tokens; its last ``sparse_prompt_tokens`` rows
  run sparse (RULER in the paper: 32), then greedy decoding runs sparse until EOS, the task's
  token limit, or every reference string appears in the output (string_match_all cannot
  change after that).

The full model runs once per sample (sparsity "dense"), first. Budgets: sparsity ``s`` means
``floor(n / s)`` attended tokens per row, windows included, with ``n`` the position where
sparse rows start (:meth:`Budget.for_sparsity`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache

from . import attention_hook, metrics, tasks, text
from .attention_hook import SparseRun, activate
from .selectors import Budget, ModelShape, Selector, SelectorSetup, SelectorUnavailable, create_selector, selector_names
from .store import ResultStore, fingerprint, record_key

log = logging.getLogger(__name__)


def _setting(name: str) -> str:
    """A setting as both the config field and its command-line flag, for messages."""
    return f"{name} (--{name.replace('_', '-')})"


#: The integer settings of :class:`EvaluationConfig` and their least values.
_COUNT_MINIMUMS = {"task_samples": 0, "nll_samples": 0, "sink_tokens": 0, "local_tokens": 0, "sparse_prompt_tokens": 0,
                   "max_new_tokens": 0, "nll_tokens": 1, "top_k": 1, "calibration_tokens": 1, "held_out_modulus": 1}


@dataclasses.dataclass
class EvaluationConfig:
    """Every setting of one evaluation (the CLI exposes each as a flag)."""

    output_dir: str
    corpus: str  # folder of .txt files (hashattention.corpus: its held-out files are the evaluation text)
    selectors: Sequence[str] = ()  # empty: every registered selector
    contexts: Sequence[int] = (2048, 4096, 8192)
    sparsities: Sequence[float] = (8, 16, 32)
    tasks: Sequence[str] = tasks.TASKS
    task_samples: int = 4
    nll_samples: int = 4
    nll_tokens: int = 64
    sparse_prompt_tokens: int = 32
    sink_tokens: int = 8
    local_tokens: int = 8
    top_k: int = 32
    seed: int = 0
    held_out_modulus: int = 10
    calibration_tokens: int = 2048
    adapters_dir: Optional[str] = None
    group_adapters_dir: Optional[str] = None
    model_name: str = ""
    max_new_tokens: int = 0  # cap on every task's generation length (0: the task's own limit)
    progress: bool = True

    def __post_init__(self):
        if not self.selectors:
            self.selectors = selector_names()
        unknown = [s for s in self.selectors if s not in selector_names()]
        if unknown:
            raise ValueError(f"{_setting('selectors')}: unknown {unknown}; registered: {selector_names()}")
        unknown = [t for t in self.tasks if t not in tasks.TASKS]
        if unknown:
            raise ValueError(f"{_setting('tasks')}: unknown {unknown}; available: {list(tasks.TASKS)}")
        for name, least in _COUNT_MINIMUMS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{_setting(name)} must be an integer >= {least}, got {value!r}")
        contexts, sparsities = list(self.contexts), list(self.sparsities)
        if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in contexts) \
                or len(set(contexts)) != len(contexts):
            raise ValueError(f"{_setting('contexts')} must be distinct positive token counts, got {contexts}")
        # NaN passes every comparison and inf makes floor(n / s) = 0: both would run the whole grid on nonsense.
        if not sparsities or len(set(sparsities)) != len(sparsities) or any(
                isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 1 for s in sparsities):
            raise ValueError(f"{_setting('sparsities')} must be distinct finite numbers >= 1 (s: floor(n / s) tokens "
                             f"per row), got {sparsities}")
        shortest = min(contexts)
        # The last nll_tokens rows of a sequence run sparse after a dense prefix, and the budget is a share
        # of that prefix: without one, every selector would keep its windows only.
        if self.nll_samples and self.nll_tokens > shortest - 2:
            raise ValueError(f"{_setting('nll_tokens')} ({self.nll_tokens}) must be at most the shortest "
                             f"{_setting('contexts')} value minus 2 ({shortest - 2}): the sparse rows follow a dense prefix")
        if self.task_samples and self.tasks and self.sparse_prompt_tokens > shortest - 2:
            raise ValueError(f"{_setting('sparse_prompt_tokens')} ({self.sparse_prompt_tokens}) must be at most the "
                             f"shortest {_setting('contexts')} value minus 2 ({shortest - 2}): the sparse rows follow a "
                             "dense prefix")

    def check_model_limits(self, model_config) -> None:
        """Refuse lengths the model cannot run (``model_config``: its transformers config; read
        before the weights load): every context and the calibration pass within ``max_position_embeddings``."""
        limit = getattr(model_config, "max_position_embeddings", None)
        if limit is None:
            return
        beyond = [c for c in self.contexts if c > limit]
        if beyond:
            raise ValueError(f"{_setting('contexts')} {beyond} exceed the model's max_position_embeddings ({limit})")
        if self.calibration_tokens > limit:
            raise ValueError(f"{_setting('calibration_tokens')} ({self.calibration_tokens}) exceeds the model's "
                             f"max_position_embeddings ({limit})")

    def window_only_budgets(self) -> List[str]:
        """Notes on the (context, sparsity) cells whose NLL budget ``floor(n / s)`` does not exceed the
        windows: there every selector keeps the sink and local windows only, and they all tie."""
        notes = []
        if not self.nll_samples:
            return notes
        for context in self.contexts:
            dense_prefix = context - 1 - self.nll_tokens
            for sparsity in self.sparsities:
                budget = Budget.for_sparsity(max(dense_prefix, 1), sparsity, self.sink_tokens, self.local_tokens)
                if budget.heavy_tokens == 0:
                    notes.append(f"NLL at {context} tokens, sparsity {sparsity:g}: the budget floor({dense_prefix} / "
                                 f"{sparsity:g}) does not exceed the windows ({self.sink_tokens} + {self.local_tokens}): "
                                 "every selector keeps the windows only")
        return notes

    def result_settings(self) -> Dict[str, Any]:
        """The settings that change per-sample results (with each selector's identity: the store's fingerprint)."""
        keys = ("nll_tokens", "sparse_prompt_tokens", "sink_tokens", "local_tokens", "top_k", "seed", "corpus",
                "held_out_modulus", "calibration_tokens", "model_name", "max_new_tokens")
        return {k: getattr(self, k) for k in keys}


def read_corpus(config: EvaluationConfig) -> Tuple[List[str], List[str]]:
    """``(held-out texts, other texts)`` of ``config.corpus``; a ValueError when it holds no held-out file."""
    held_out = text.read_split(config.corpus, held_out=True, modulus=config.held_out_modulus)
    if not held_out:
        raise ValueError(f"corpus {config.corpus!r} has no held-out file (crc32(path) % {config.held_out_modulus} == 0)")
    return held_out, text.read_split(config.corpus, held_out=False, modulus=config.held_out_modulus)


class _DenseObservers(Selector):
    """Forwards the dense rows of the shared prefill to every selector that keeps statistics of them."""

    def __init__(self, selectors: Sequence[Selector]):
        super().__init__()
        self.selectors = list(selectors)

    def observe_dense(self, layer, query, key, scaling):
        for selector in self.selectors:
            selector.observe_dense(layer, query, key, scaling)


class _CalibrationCapture(Selector):
    """Keeps every layer's post-RoPE queries and keys of a dense pass."""

    def __init__(self):
        super().__init__()
        self.captured = {}

    def observe_dense(self, layer, query, key, scaling):
        self.captured[layer] = (query.detach().float().cpu(), key.detach().float().cpu())


def _observes_dense(selector: Selector) -> bool:
    return type(selector).observe_dense is not Selector.observe_dense


@torch.no_grad()
def _forward(model, input_ids: List[int], cache, logits_to_keep: int = 1):
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)
    return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)


class Evaluation:
    """One evaluation of ``model`` (a transformers causal LM) with ``tokenizer``.

    ``model=None`` with ``model_config`` (its transformers config) builds an evaluation that can
    only report what the per-sample cache holds (``run(compute=False)``): no weights are loaded.
    """

    def __init__(self, model, tokenizer, config: EvaluationConfig, model_config=None):
        if model is None and model_config is None:
            raise ValueError("Evaluation needs the model, or its config to report from the cache only")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        model_config = model.config if model is not None else model_config
        config.check_model_limits(model_config)
        self.shape = ModelShape.from_config(model_config)
        self.store = ResultStore(f"{config.output_dir}/samples.jsonl")
        self.fingerprints: Dict[str, str] = {}
        self.notes: List[str] = config.window_only_budgets()
        self.selectors: Dict[str, Selector] = {}
        self.unavailable: Dict[str, str] = {}
        held_out, rest = read_corpus(config)
        if not rest:
            self.notes.append("the corpus has no non-held-out file: calibration text is the held-out text")
            rest = held_out
        self.held_out_texts, self.other_texts = held_out, rest
        self.sentences = text.sentences(held_out)
        self.words = text.word_pool(rest + held_out)
        self._held_out_ids: Optional[List[int]] = None

    # ------------------------------------------------------------------ setup
    def _token_ids(self, texts: Sequence[str], count: int) -> List[int]:
        ids: List[int] = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for document in texts:
            ids.extend(self.tokenizer.encode(document, add_special_tokens=False))
            if eos is not None:
                ids.append(int(eos))
            if len(ids) >= count:
                break
        return ids[:count]

    def _calibration(self) -> Dict[int, Any]:
        ids = self._token_ids(self.other_texts, self.config.calibration_tokens)
        capture = _CalibrationCapture()
        with attention_hook.evaluation_attention(self.model), activate(SparseRun(selector=capture)):
            _forward(self.model, ids, DynamicCache(config=self.model.config))
        return capture.captured

    def prepare_selectors(self) -> None:
        """Prepare every selector of the config (the unavailable ones are noted and skipped); without a
        model, only as far as their identities need (to find their results in the cache)."""
        setup = SelectorSetup(
            shape=self.shape,
            calibration=self._calibration() if self.model is not None else None,
            identity_only=self.model is None,
            adapters_dir=self.config.adapters_dir,
            group_adapters_dir=self.config.group_adapters_dir,
            seed=self.config.seed,
        )
        for name in self.config.selectors:
            selector = create_selector(name)
            try:
                selector.prepare(setup)
            except SelectorUnavailable as error:
                self.unavailable[name] = str(error)
                self.notes.append(f"selector {name} skipped: {error}")
                log.warning("selector %s skipped: %s", name, error)
                continue
            self.selectors[name] = selector
            self.fingerprints[name] = fingerprint({**self.config.result_settings(), **selector.identity()})

    def key(self, kind: str, context: int, index: int, name: str, sparsity: Optional[float], task: str = "") -> str:
        """The store key of one per-sample result."""
        return record_key(self.fingerprints[name], kind, context, index, name, sparsity, task)

    def check_task_prompts(self) -> None:
        """Build the first sample of every task at the shortest context, so that a context too short
        for a task's bare prompt fails before any computation rather than in the middle of the grid."""
        shortest = min(self.config.contexts)
        for task in self.config.tasks:
            try:
                tasks.build_sample(task, 0, shortest, self.config.seed, self.tokenizer, self.sentences, self.words)
            except ValueError as error:
                raise ValueError(f"{_setting('contexts')} {shortest} does not fit task {task}: {error}") from error

    # ------------------------------------------------------------------ jobs
    def _jobs(self):
        """(selector name, sparsity or None) in evaluation order: the full model first."""
        jobs = []
        for name, selector in self.selectors.items():
            if selector.dense:
                jobs.append((name, None))
            else:
                jobs.extend((name, float(s)) for s in self.config.sparsities)
        return jobs

    def _prefill(self, prefix_ids: List[int], jobs):
        """Dense prefill shared by the jobs of one sample: ``(cache, per-selector states)``."""
        for selector in self.selectors.values():
            selector.start_sequence()
        pending = {name for name, _ in jobs}  # selectors whose results are all cached need no statistics
        observers = _DenseObservers([s for n, s in self.selectors.items() if n in pending and _observes_dense(s)])
        cache = DynamicCache(config=self.model.config)
        with activate(SparseRun(selector=observers)):
            _forward(self.model, prefix_ids, cache)
        return cache, {name: s.save_state() for name, s in self.selectors.items()}

    def _budget(self, sparse_from: int, sparsity: Optional[float]) -> Optional[Budget]:
        if sparsity is None:
            return None
        return Budget.for_sparsity(sparse_from, sparsity, self.config.sink_tokens, self.config.local_tokens)

    def _nll_sequence(self, context: int, index: int) -> List[int]:
        needed = (index + 1) * context
        if self._held_out_ids is None or len(self._held_out_ids) < needed:
            self._held_out_ids = self._token_ids(self.held_out_texts, max(needed, 4 * context))
        ids = self._held_out_ids[index * context : (index + 1) * context]
        if len(ids) < context:
            raise ValueError(f"the held-out text has fewer than {needed} tokens for NLL sample {index} at {context}")
        return ids

    def _run_nll(self, context: int, index: int, bar) -> None:
        cfg = self.config
        jobs = [(n, s) for n, s in self._jobs() if self.key("nll", context, index, n, s) not in self.store]
        if not jobs:
            return
        ids = self._nll_sequence(context, index)
        sparse_from = context - 1 - cfg.nll_tokens  # >= 1: EvaluationConfig checks nll_tokens against the contexts
        cache, states = self._prefill(ids[:sparse_from], jobs)
        chunk, targets = ids[sparse_from : context - 1], torch.tensor(ids[sparse_from + 1 :])
        for name, sparsity in jobs:
            selector = self.selectors[name]
            selector.load_state(states[name])
            recorder = metrics.SelectionRecorder(cfg.sink_tokens, cfg.local_tokens, cfg.top_k)
            run = SparseRun(selector, self._budget(sparse_from, sparsity), sparse_from, recorder)
            started = time.perf_counter()
            with activate(run):
                out = _forward(self.model, chunk, copy.deepcopy(cache), logits_to_keep=0)
            nll = metrics.token_nll(out.logits[0].float().cpu(), targets)
            layers = recorder.per_layer()
            self.store.add(self.key("nll", context, index, name, sparsity), {
                "kind": "nll", "context": context, "sample": index, "selector": name, "sparsity": sparsity,
                "nll_sum": float(nll.sum()), "tokens": int(nll.numel()),
                "recall_per_layer": layers["recall"], "mass_per_layer": layers["mass"],
                "seconds": time.perf_counter() - started,
            })
            bar.update(1)

    def _run_task(self, task: str, context: int, index: int, bar) -> None:
        cfg = self.config
        jobs = [(n, s) for n, s in self._jobs() if self.key("task", context, index, n, s, task) not in self.store]
        if not jobs:
            return
        sample = tasks.build_sample(task, index, context, cfg.seed, self.tokenizer, self.sentences, self.words)
        ids = sample.input_ids
        sparse_from = max(len(ids) - cfg.sparse_prompt_tokens, 1)
        cache, states = self._prefill(ids[:sparse_from], jobs)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for name, sparsity in jobs:
            selector = self.selectors[name]
            selector.load_state(states[name])
            run = SparseRun(selector, self._budget(sparse_from, sparsity), sparse_from, None)
            started = time.perf_counter()
            generated: List[int] = []
            step_cache = copy.deepcopy(cache)
            with activate(run):
                logits = _forward(self.model, ids[sparse_from:], step_cache).logits
                limit = min(sample.max_new_tokens, cfg.max_new_tokens or sample.max_new_tokens)
                for _ in range(limit):
                    token = int(logits[0, -1].argmax())
                    if eos is not None and token == eos:
                        break
                    generated.append(token)
                    if metrics.string_match_all(self.tokenizer.decode(generated), sample.references) == 1.0:
                        break
                    logits = _forward(self.model, [token], step_cache).logits
            output = self.tokenizer.decode(generated, skip_special_tokens=True)
            self.store.add(self.key("task", context, index, name, sparsity, task), {
                "kind": "task", "task": task, "context": context, "sample": index, "selector": name,
                "sparsity": sparsity, "prompt_tokens": len(ids), "output": output, "references": sample.references,
                "score": metrics.string_match_all(output, sample.references),
                "seconds": time.perf_counter() - started,
            })
            bar.update(1)

    def task_prompt_selection(self, task: str, context: int, index: int) -> Dict[Tuple[str, Optional[float]], Dict[str, List]]:
        """Selection quality where a task is decided: at the sparse rows of its prompt (the question).

        A diagnostic, not cached: the prompt of task sample ``index`` is prefilled densely up to its
        last ``sparse_prompt_tokens`` rows, then every (selector, sparsity) job runs those rows and a
        :class:`~.metrics.NeedleRecorder` measures recall of the true top-k and attention mass per
        layer and the needle attention kept at the last row (no generation). Returns
        ``{(selector, sparsity): {"recall": [...], "mass": [...], "needle_kept": float or None}}``
        (per-layer means; None where the answers are not in the prompt verbatim; the full model is
        skipped: it selects everything).
        """
        if self.model is None:
            raise ValueError("task_prompt_selection runs the model: this Evaluation was built without one")
        if not self.selectors:
            self.prepare_selectors()
        cfg = self.config
        jobs = [(n, s) for n, s in self._jobs() if s is not None]
        sample = tasks.build_sample(task, index, context, cfg.seed, self.tokenizer, self.sentences, self.words)
        ids = sample.input_ids
        sparse_from = max(len(ids) - cfg.sparse_prompt_tokens, 1)
        needle = self._answer_positions(ids[:sparse_from], sample.references)
        quality = {}
        with torch.no_grad(), attention_hook.evaluation_attention(self.model):
            cache, states = self._prefill(ids[:sparse_from], jobs)
            for name, sparsity in jobs:
                selector = self.selectors[name]
                selector.load_state(states[name])
                recorder = metrics.NeedleRecorder(cfg.sink_tokens, cfg.local_tokens, cfg.top_k, needle)
                with activate(SparseRun(selector, self._budget(sparse_from, sparsity), sparse_from, recorder)):
                    _forward(self.model, ids[sparse_from:], copy.deepcopy(cache))
                quality[(name, sparsity)] = {**recorder.per_layer(), "needle_kept": recorder.needle_kept()}
        return quality

    def _answer_positions(self, ids: Sequence[int], references: Sequence[str]) -> List[int]:
        """Prompt positions holding the answers' tokens (as the tokenizer splits them in running text,
        after a space or not); empty when an answer does not appear in the prompt verbatim."""
        positions: List[int] = []
        for reference in references:
            found: List[int] = []
            for form in (" " + reference, reference):
                found = metrics.find_spans(ids, self.tokenizer.encode(form, add_special_tokens=False))
                if found:
                    break
            if not found:
                return []
            positions.extend(found)
        return sorted(set(positions))

    def run(self, compute: bool = True) -> Dict[str, Any]:
        """Run every missing job (cached ones are skipped) and return the aggregated results.

        ``compute=False`` only aggregates what the cache already holds (missing cells stay empty).
        """
        from tqdm.auto import tqdm

        from .report import aggregate

        torch.manual_seed(self.config.seed)
        cfg = self.config
        if self.model is None:
            if compute:
                raise ValueError("this Evaluation has no model: it can only report from the cache (compute=False)")
            if not self.selectors:
                self.prepare_selectors()
            return aggregate(self)
        with attention_hook.evaluation_attention(self.model):
            if not self.selectors:
                self.prepare_selectors()
            if not compute:
                return aggregate(self)
            if cfg.task_samples:
                self.check_task_prompts()
            per_sample = len(self._jobs())
            total = per_sample * len(cfg.contexts) * (cfg.nll_samples + cfg.task_samples * len(cfg.tasks))
            with tqdm(total=total, disable=not cfg.progress, desc="evaluation", unit="job") as bar:
                for context in cfg.contexts:
                    for index in range(cfg.nll_samples):
                        bar.set_postfix_str(f"nll {context} #{index}")
                        before = bar.n
                        self._run_nll(context, index, bar)
                        bar.update(per_sample - (bar.n - before))  # cached jobs count as done
                    for task in cfg.tasks:
                        for index in range(cfg.task_samples):
                            bar.set_postfix_str(f"{task} {context} #{index}")
                            before = bar.n
                            self._run_task(task, context, index, bar)
                            bar.update(per_sample - (bar.n - before))
        return aggregate(self)
