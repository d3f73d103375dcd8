"""Command line: ``python -m hashattention.evaluation [options]``.

Writes ``results.md``, ``results.json``, ``recall_vs_sparsity.png``, ``task_score_vs_sparsity.png``,
``recall_per_layer.png`` and the per-sample cache ``samples.jsonl`` into ``--output-dir``.
Re-running the same command resumes: finished per-sample results are read back, not recomputed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

import torch

from ..adapters import pretrained_names, pretrained_path
from . import tasks, text
from .harness import Evaluation, EvaluationConfig, read_corpus
from .report import markdown, write_report
from .selectors import selector_names

#: The shipped adapters that ``--model smollm2`` uses unless ``--adapters`` says otherwise.
SMOLLM2_ADAPTERS = "smollm2-135m-instruct"


def _ints(value: str) -> List[int]:
    return [int(v) for v in value.split(",") if v]


def _floats(value: str) -> List[float]:
    return [float(v) for v in value.split(",") if v]


def _names(value: str) -> List[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: torch's default), got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hashattention.evaluation",
        description="Compare KV-selection methods (full, oracle top-k, StreamingLLM, H2O, Quest, Double Sparsity, "
                    "SimHash LSH, HashAttention) on one model: recall of the true top-k, attention mass, NLL and "
                    "RULER-style tasks. Writes a Markdown table, JSON and PNG plots; resumes from its per-sample cache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (the offline SmolLM2-135M-Instruct GGUF) or a local Hugging Face model directory")
    parser.add_argument("--tokenizer", default="auto", choices=("auto", "byte"),
                        help="'auto': the model's tokenizer; 'byte': UTF-8 bytes (tiny test models, vocab >= 257)")
    parser.add_argument("--output-dir", default=os.path.join("results", "evaluation"))
    parser.add_argument("--selectors", type=_names, default=[],
                        help=f"comma-separated; default all: {','.join(selector_names())}")
    parser.add_argument("--list-selectors", action="store_true", help="print the registered selectors and exit")
    parser.add_argument("--contexts", type=_ints, default=[2048, 4096, 8192], help="context lengths in tokens")
    parser.add_argument("--sparsities", type=_floats, default=[8.0, 16.0, 32.0],
                        help="s: floor(n / s) attended tokens per row, windows included")
    parser.add_argument("--tasks", type=_names, default=list(tasks.TASKS), help="comma-separated RULER-style tasks")
    parser.add_argument("--task-samples", type=int, default=4, help="samples per task and context")
    parser.add_argument("--nll-samples", type=int, default=4, help="held-out sequences per context for NLL and recall")
    parser.add_argument("--nll-tokens", type=int, default=64, help="last tokens of each sequence decoded sparsely")
    parser.add_argument("--sparse-prompt-tokens", type=int, default=32,
                        help="last prompt tokens of a task that already run sparse (the paper's RULER setting: 32)")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="cap on generated tokens per task answer (0: each task's own limit)")
    parser.add_argument("--sink-tokens", type=int, default=8)
    parser.add_argument("--local-tokens", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=32, help="k of the recall metric")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None,
                        help="folder of .txt files; required to evaluate (in a clone: ../shared/corpus, or the small "
                             "train/sample_corpus)")
    parser.add_argument("--held-out-modulus", type=int, default=10,
                        help="a corpus file is evaluation text iff crc32(relative path) %% modulus == 0")
    parser.add_argument("--calibration-tokens", type=int, default=2048,
                        help="tokens of non-held-out text for Double Sparsity's channel calibration")
    parser.add_argument("--adapters", default=None,
                        help="trained HashAttention adapters (a directory or a shipped name); default for smollm2: the shipped "
                             f"{SMOLLM2_ADAPTERS!r} adapters")
    parser.add_argument("--group-adapters", default=None,
                        help="adapters for the group-shared selector (default: --adapters)")
    parser.add_argument("--threads", type=_non_negative_int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--report-only", action="store_true",
                        help="compute nothing: write the tables and plots from the per-sample cache as it is "
                             "(reads the model's config, not its weights)")
    return parser


def model_display_name(name: str) -> str:
    """The model's name in the results: the offline model's, or the directory's base name."""
    if name == "smollm2":
        from ..offline_model import MODEL_NAME

        return MODEL_NAME
    return os.path.basename(os.path.abspath(name))


def load_model_config(name: str):
    """The transformers config of ``--model``, read without the weights (seconds, not the model's load)."""
    from transformers import AutoConfig

    if name == "smollm2":
        from ..offline_model import smollm2_config

        return smollm2_config()
    if not os.path.isdir(name):
        raise ValueError(f"--model must be 'smollm2' or a local model directory, got {name!r}")
    return AutoConfig.from_pretrained(name)


def load_model(name: str, tokenizer_kind: str):
    """``(model, tokenizer)``."""
    if name == "smollm2":
        from ..offline_model import load_smollm2

        model, tokenizer = load_smollm2()
        return model, (text.ByteTokenizer() if tokenizer_kind == "byte" else tokenizer)
    if not os.path.isdir(name):
        raise ValueError(f"--model must be 'smollm2' or a local model directory, got {name!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    tokenizer = text.ByteTokenizer() if tokenizer_kind == "byte" else AutoTokenizer.from_pretrained(name)
    return model, tokenizer


def adapter_directory(value, flag: str):
    """The adapter directory that ``value`` names: a directory, or the name of shipped adapters.

    A value that is neither is an error here, before the model loads, instead of learned rows
    silently skipped later."""
    if value is None or os.path.isdir(value):
        return value
    if value in pretrained_names():
        return pretrained_path(value)
    raise ValueError(f"{flag} {value!r} is neither a directory nor shipped adapters (shipped: {pretrained_names()})")


def evaluation_from_args(args: argparse.Namespace) -> Evaluation:
    """The model, tokenizer and :class:`Evaluation` that the parsed command-line ``args`` describe.

    Every argument is checked before the model loads (the offline model takes tens of seconds):
    the flags themselves, then what the model's config and the corpus decide (lengths within
    the model's positions, a held-out file). With ``--report-only`` the weights are not loaded.
    """
    if args.corpus is None:
        raise ValueError("--corpus DIR is required: the folder of .txt files to evaluate on")
    if args.threads:
        torch.set_num_threads(args.threads)
    adapters = adapter_directory(args.adapters, "--adapters")
    if adapters is None and args.model == "smollm2" and SMOLLM2_ADAPTERS in pretrained_names():
        adapters = pretrained_path(SMOLLM2_ADAPTERS)
    config = EvaluationConfig(
        output_dir=args.output_dir,
        selectors=args.selectors,
        contexts=args.contexts,
        sparsities=args.sparsities,
        tasks=args.tasks,
        task_samples=args.task_samples,
        nll_samples=args.nll_samples,
        nll_tokens=args.nll_tokens,
        sparse_prompt_tokens=args.sparse_prompt_tokens,
        sink_tokens=args.sink_tokens,
        local_tokens=args.local_tokens,
        top_k=args.top_k,
        seed=args.seed,
        corpus=os.path.abspath(args.corpus),
        held_out_modulus=args.held_out_modulus,
        calibration_tokens=args.calibration_tokens,
        adapters_dir=adapters,
        group_adapters_dir=adapter_directory(args.group_adapters, "--group-adapters"),
        model_name=model_display_name(args.model),
        max_new_tokens=args.max_new_tokens,
        progress=not args.no_progress,
    )
    model_config = load_model_config(args.model)
    config.check_model_limits(model_config)
    if args.tokenizer == "byte" and model_config.vocab_size < text.ByteTokenizer.vocab_size:
        raise ValueError(f"--tokenizer byte needs a vocabulary of at least {text.ByteTokenizer.vocab_size} tokens, "
                         f"the model has {model_config.vocab_size}")
    read_corpus(config)  # a corpus without held-out text fails here, not after the model loads
    if args.report_only:
        return Evaluation(None, None, config, model_config=model_config)
    model, tokenizer = load_model(args.model, args.tokenizer)
    return Evaluation(model, tokenizer, config)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_selectors:
        print("\n".join(selector_names()))
        return 0
    if args.corpus is None:
        parser.error("--corpus DIR is required: the folder of .txt files to evaluate on")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    results = evaluation_from_args(args).run(compute=not args.report_only)
    paths = write_report(results, args.output_dir)
    print(markdown(results))
    print("wrote " + ", ".join(sorted(paths.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
