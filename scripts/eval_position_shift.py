"""Does a selector's recall depend on absolute positions? The same text, shifted in position.

RoPE attention scores depend only on relative positions, so running a held-out sequence with
position ids ``offset .. offset + n - 1`` leaves the true ``q.k`` -- and the dense model's
predictions -- unchanged, while the post-RoPE queries and keys a selector reads are those of
absolute positions ``offset`` and later. A selector whose recall drops with the offset has learned
(or, for fixed rules, depends on) absolute positions. The shipped SmolLM2 adapters were trained on
2048-token sequences, so offsets >= 2048 show how they behave at 4K/8K positions on text whose
relative structure is that of a 2K context.

Usage (writes JSON and a Markdown table; recall/mass/NLL as in the evaluation harness):

    python scripts/eval_position_shift.py --offsets 0,2048,6144 --samples 2 \\
        --selectors hashattention,hashattention-group,lsh-32,double_sparsity-r2,h2o \\
        --output results/evaluation/smollm2-8k/position_shift
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from hashattention.evaluation import attention_hook, metrics
from hashattention.evaluation.attention_hook import SparseRun, activate
from hashattention.evaluation.cli import PRETRAINED_SMOLLM2, load_model
from hashattention.evaluation.harness import Evaluation, EvaluationConfig, _observes_dense


def forward(model, ids, first_position, cache):
    """Logits of every row of ``ids`` placed at positions ``first_position ..``."""
    positions = torch.arange(first_position, first_position + len(ids))[None]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache,
                     use_cache=True, logits_to_keep=0).logits[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selectors", default="hashattention,hashattention-group,lsh-32,double_sparsity-r2")
    parser.add_argument("--offsets", default="0,2048,6144", help="position offsets (comma-separated)")
    parser.add_argument("--samples", type=int, default=1, help="held-out sequences")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--sparsity", type=float, default=16.0)
    parser.add_argument("--nll-tokens", type=int, default=64, help="last tokens run sparse")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--adapters", default=PRETRAINED_SMOLLM2, help="trained HashAttention adapters (directory)")
    parser.add_argument("--output", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = ["full"] + [n for n in args.selectors.split(",") if n and n != "full"]
    offsets = [int(x) for x in args.offsets.split(",")]

    model, tokenizer, model_name = load_model("smollm2", "auto")
    config = EvaluationConfig(output_dir="unused", selectors=names, contexts=[args.context], sparsities=[args.sparsity],
                              adapters_dir=args.adapters, model_name=model_name, progress=False)
    evaluation = Evaluation(model, tokenizer, config)
    sparse_from = args.context - 1 - args.nll_tokens
    rows = {}
    with attention_hook.evaluation_attention(model):
        evaluation.prepare_selectors()
        for index in range(args.samples):
            ids = evaluation._nll_sequence(args.context, index)
            targets = torch.tensor(ids[sparse_from + 1 :])
            for offset in offsets:
                cache = DynamicCache(config=model.config)
                with activate(SparseRun(selector=None)):  # dense prefill
                    forward(model, ids[:sparse_from], offset, cache)
                for name in names:
                    selector = evaluation.selectors[name]
                    selector.start_sequence()
                    if _observes_dense(selector):
                        # selectors with prefill statistics (H2O) need the prefill watched: run it again for them
                        cache_for = DynamicCache(config=model.config)
                        with activate(SparseRun(selector=selector, sparse_from=None)):
                            forward(model, ids[:sparse_from], offset, cache_for)
                    else:
                        cache_for = copy.deepcopy(cache)
                    recorder = metrics.SelectionRecorder(config.sink_tokens, config.local_tokens, config.top_k)
                    budget = None if selector.dense else evaluation._budget(sparse_from, args.sparsity)
                    with activate(SparseRun(selector, budget, sparse_from, recorder)):
                        logits = forward(model, ids[sparse_from : args.context - 1], offset + sparse_from, cache_for)
                    layers = recorder.per_layer()
                    row = rows.setdefault((name, offset), {"recall": [], "mass": [], "nll": []})
                    row["recall"].append(metrics.mean_ignoring_none(layers["recall"]))
                    row["mass"].append(metrics.mean_ignoring_none(layers["mass"]))
                    row["nll"].append(float(metrics.token_nll(logits.float(), targets).mean()))
                    print(f"sample {index} offset {offset} {name}: recall {row['recall'][-1]:.3f} "
                          f"mass {row['mass'][-1]:.3f} nll {row['nll'][-1]:.4f}", flush=True)

    mean = lambda values: sum(values) / len(values)
    table = [f"Position-shift check: {args.samples} held-out sequence(s) of {args.context} tokens, last "
             f"{args.nll_tokens} sparse at {args.sparsity:g}x, run at position offsets {offsets} "
             "(mean NLL per token; dense NLL must not move).", "",
             "| selector | " + " | ".join(f"recall@{config.top_k} +{o}" for o in offsets) + " | "
             + " | ".join(f"NLL +{o}" for o in offsets) + " |",
             "|---|" + "---:|" * (2 * len(offsets))]
    for name in names:
        recall = [f"{mean(rows[(name, o)]['recall']):.3f}" for o in offsets]
        nll = [f"{mean(rows[(name, o)]['nll']):.4f}" for o in offsets]
        table.append(f"| {name} | " + " | ".join(recall + nll) + " |")
    with open(args.output + ".md", "w") as f:
        f.write("\n".join(table) + "\n")
    with open(args.output + ".json", "w") as f:
        json.dump({"settings": vars(args), "rows": [{"selector": n, "offset": o, **rows[(n, o)]} for n, o in rows]},
                  f, indent=1)
    print("\n".join(table))


if __name__ == "__main__":
    main()
