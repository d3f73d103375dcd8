"""`make demo`: passkey retrieval with SmolLM2-135M-Instruct, dense attention vs HashAttention at 16x.

A passkey is hidden in a public-domain document shipped in data/ (Austen's *Persuasion*,
chapters 1-4); the model is asked for it twice, with dense attention and with HashAttention
(16x sparsity: each query attends to n/16 of the n keys, windows included). Printed: both
answers, the share of the true top-32 attention keys (by q.k) that the selection captured,
K/V bytes read per decode step, and tokens/s on this machine's CPU.

The model is the offline GGUF SmolLM2 (hashattention.offline_model); the adapters are the
trained ones shipped with the package (``HashAdapters.from_pretrained("smollm2-135m-instruct")``),
or, where a build lacks them, randomly initialised ones (random-projection-like signatures; the
demo says so).

    python examples/demo.py [--context-tokens 3000] [--depth 0.4] [--sparsity 16]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the demo runs from the checkout
DOCUMENT = os.path.join(REPO, "data", "persuasion_chapters_1_4.txt")
ADAPTERS = "smollm2-135m-instruct"  # shipped with the package
PROBE_NAME = "hashattention_demo_probe"
TOP_KEYS = 32


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-tokens", type=int, default=3000, help="document tokens in the prompt")
    parser.add_argument("--depth", type=float, default=0.4, help="where the passkey sits (0 = start, 1 = end)")
    parser.add_argument("--sparsity", type=float, default=16.0)
    parser.add_argument("--sink-tokens", type=int, default=16, help="scaled down from the paper's 128 for a 3K context")
    parser.add_argument("--local-tokens", type=int, default=32, help="scaled down from the paper's 128")
    parser.add_argument("--sparse-prompt-tokens", type=int, default=32, help="paper: 32 for RULER")
    parser.add_argument("--selection", choices=("query_head", "kv_group"), default="query_head")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    return parser.parse_args()


def build_prompt(tokenizer, context_tokens: int, depth: float, passkey: str):
    with open(DOCUMENT, encoding="utf-8") as f:
        document = f.read()
    words = document.split()
    needle = f"The secret passkey is {passkey}. Remember it: the secret passkey is {passkey}."
    question = "What is the secret passkey hidden in the text above? Answer with the number only."

    def prompt_for(word_count: int):
        text = words[:word_count]
        at = int(len(text) * depth)
        body = " ".join(text[:at] + [needle] + text[at:])
        messages = [{"role": "user", "content": f"{body}\n\n{question}"}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    # Grow the excerpt until the prompt reaches the wanted length (a few tokenizer calls).
    low, high = 1, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if prompt_for(middle)["input_ids"].shape[1] <= context_tokens:
            low = middle
        else:
            high = middle - 1
    return prompt_for(low)


def load_adapters(model):
    from hashattention.adapters import HashAdapters, pretrained_names

    if ADAPTERS in pretrained_names():
        adapters = HashAdapters.from_pretrained(ADAPTERS)
        mean = (adapters.config.validation or {}).get("mean", {}).get("learned", {})
        recall = ", ".join(f"{k} {v:.3f}" for k, v in sorted(mean.items())) or "not recorded"
        return adapters, f"trained adapters {ADAPTERS!r} (held-out recall of the true top-32: {recall})"
    torch.manual_seed(0)
    adapters = HashAdapters.for_model_config(model.config)
    return adapters, (
        f"RANDOMLY INITIALISED adapters (this build of hashattention ships no {ADAPTERS!r}): "
        "the signatures are random-projection-like, untrained"
    )


class SelectionProbe:
    """Wraps the hashattention attention function to measure each decode step's selection.

    For the single query row of every decode call and every layer: the true top-32 keys by
    q.k (per query head, GQA-expanded), the selection the ops make for it (recomputed from the
    same inputs with the same op), recall of the top-32, and the K/V bytes each path reads.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.recall_hits = self.recall_total = 0
        self.heavy_hits = self.heavy_total = 0
        self.random_expected = []
        self.dense_bytes = self.sparse_kv_bytes = self.signature_bytes = 0
        self.layer_calls = 0
        self.seconds = 0.0  # time spent measuring, excluded from the reported speed

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        from hashattention.attention import hashattention_attention_forward

        runtime = kwargs.get("hashattention")
        cache_layer = kwargs.get("hashattention_cache_layer")
        result = hashattention_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
        if runtime is not None and cache_layer is not None and query.shape[2] == 1 and query.shape[0] == 1:
            start = time.perf_counter()
            self.measure(runtime, cache_layer, query, key)
            self.seconds += time.perf_counter() - start
        return result

    @torch.no_grad()
    def measure(self, runtime, cache_layer, query, key):
        from hashattention import ops

        config = runtime.config
        q_heads, kv_heads, n, head_dim = query.shape[1], key.shape[1], key.shape[2], key.shape[3]
        lengths = torch.tensor([n], dtype=torch.int32)
        indices, counts = ops.hamming_topk(
            runtime.adapter.query_signatures(query),
            cache_layer.key_signatures,
            selection_heads=runtime.selection_heads,
            sink_tokens=config.sink_tokens,
            local_tokens=config.local_tokens,
            budget_tokens=config.heavy_width(n),
            lengths=lengths,
            budgets=config.heavy_tokens(lengths),
        )
        group = q_heads // runtime.selection_heads
        keys = key.repeat_interleave(q_heads // kv_heads, dim=1)[0].float()  # (Hq, n, D)
        scores = torch.einsum("hd,hnd->hn", query[0, :, 0].float(), keys)
        window = torch.zeros(n, dtype=torch.bool)
        window[: config.sink_tokens] = True
        window[max(0, n - config.local_tokens):] = True
        for head in range(q_heads):
            chosen = indices[0, head // group, 0, : counts[0, head // group, 0]].long()
            selected = torch.zeros(n, dtype=torch.bool)
            selected[chosen] = True
            top = scores[head].topk(min(TOP_KEYS, n)).indices
            self.recall_hits += int(selected[top].sum())
            self.recall_total += top.numel()
            outside = scores[head].masked_fill(window, float("-inf"))
            candidates = int((~window).sum())
            if candidates > TOP_KEYS:
                top_outside = outside.topk(TOP_KEYS).indices
                self.heavy_hits += int(selected[top_outside].sum())
                self.heavy_total += TOP_KEYS
                self.random_expected.append(int((selected & ~window).sum()) / candidates)
        element = key.element_size()
        words = cache_layer.key_signatures.shape[-1]
        self.dense_bytes += 2 * kv_heads * n * head_dim * element
        # Each selection list reads its rows of K and V once (per query head, or once per KV group).
        self.sparse_kv_bytes += int(counts.sum()) * 2 * head_dim * element
        self.signature_bytes += cache_layer.key_signatures.shape[1] * n * words * 4
        self.layer_calls += 1


def greedy(model, inputs, max_new_tokens: int, eos_ids, probe=None):
    """Prefill, then greedy decode with a DynamicCache; returns (new token ids, prefill s, decode tokens/s).

    Time the probe spends measuring the selection is subtracted from the decode time.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        start = time.perf_counter()
        out = model(**inputs, past_key_values=cache, use_cache=True)
        prefill = time.perf_counter() - start
        token = out.logits[:, -1:].argmax(-1)
        tokens = [int(token)]
        mask = inputs["attention_mask"]
        start = time.perf_counter()
        measuring = probe.seconds if probe is not None else 0.0
        for _ in range(max_new_tokens - 1):
            if tokens[-1] in eos_ids:
                break
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(int(token))
        steps = len(tokens) - 1
        measuring = (probe.seconds - measuring) if probe is not None else 0.0
        decode_rate = steps / (time.perf_counter() - start - measuring) if steps else float("nan")
    return tokens, prefill, decode_rate


def mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import hashattention
    from hashattention.attention import register
    from hashattention.config import HashAttentionConfig
    from hashattention.offline_model import MODEL_NAME, load_smollm2
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    print("HashAttention demo: passkey retrieval, dense attention vs HashAttention")
    print(f"  extension: CPU kernels{' + CUDA kernels' if hashattention.WITH_CUDA else ''}; running on CPU, "
          f"{torch.get_num_threads()} threads")
    start = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=torch.float32)
    print(f"  model: {MODEL_NAME}, loaded in {time.perf_counter() - start:.0f}s")
    passkey = str(random.Random(args.seed).randint(10000, 99999))
    inputs = build_prompt(tokenizer, args.context_tokens, args.depth, passkey)
    n = inputs["input_ids"].shape[1]
    print(f"  document: {os.path.relpath(DOCUMENT, REPO)}; prompt {n} tokens, passkey {passkey} at depth {args.depth:.0%}")
    configured_eos = model.generation_config.eos_token_id
    configured_eos = [configured_eos] if isinstance(configured_eos, int) else list(configured_eos or [])
    eos_ids = {tokenizer.eos_token_id, *configured_eos} - {None}

    tokens, prefill, rate = greedy(model, inputs, args.max_new_tokens, eos_ids)
    dense_answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()

    adapters, adapter_description = load_adapters(model)
    config = HashAttentionConfig(
        sink_tokens=args.sink_tokens,
        local_tokens=args.local_tokens,
        sparsity=args.sparsity,
        sparse_prompt_tokens=args.sparse_prompt_tokens,
        selection=args.selection,
    )
    probe = SelectionProbe()
    register()
    AttentionInterface.register(PROBE_NAME, probe)
    AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
    with hashattention.patch(model, adapters, config):
        model.set_attn_implementation(PROBE_NAME)  # the hashattention function, measured
        sparse_tokens, sparse_prefill, sparse_rate = greedy(model, inputs, args.max_new_tokens, eos_ids, probe)
    sparse_answer = tokenizer.decode(sparse_tokens, skip_special_tokens=True).strip()

    def verdict(answer):
        return "correct" if passkey in answer else "wrong"

    print()
    print(f"selector: {adapter_description}")
    print(f"HashAttention config: {config.describe()}")
    print(f"  at n = {n}: {config.total_tokens(n)} tokens attended per query ({n / config.total_tokens(n):.1f}x fewer)")
    print()
    print(f"dense attention   : {dense_answer!r}  [{verdict(dense_answer)}]")
    print(f"HashAttention {args.sparsity:g}x: {sparse_answer!r}  [{verdict(sparse_answer)}]")
    print()
    if probe.layer_calls:
        steps = probe.layer_calls / model.config.num_hidden_layers
        print(f"selection quality over {steps:.0f} decode steps x {model.config.num_hidden_layers} layers x "
              f"{model.config.num_attention_heads} query heads:")
        print(f"  true top-{TOP_KEYS} keys (by q.k) captured by the selection (windows included): "
              f"{probe.recall_hits / probe.recall_total:.1%}")
        if probe.heavy_total:
            random_share = sum(probe.random_expected) / len(probe.random_expected)
            print(f"  top-{TOP_KEYS} keys outside the windows captured by the signature-selected tokens: "
                  f"{probe.heavy_hits / probe.heavy_total:.1%} (a uniformly random pick of the same size: "
                  f"{random_share:.1%})")
        per_step = 1.0 / steps
        print(f"K/V bytes read per decode step (all layers, {str(model.dtype).replace('torch.', '')}):")
        print(f"  dense       : {mib(probe.dense_bytes * per_step)}")
        print(f"  HashAttention: {mib(probe.sparse_kv_bytes * per_step)} of K/V rows + "
              f"{mib(probe.signature_bytes * per_step)} of key signatures "
              f"= {probe.dense_bytes / (probe.sparse_kv_bytes + probe.signature_bytes):.1f}x fewer bytes"
              + (" (per-query-head selection under GQA reads each KV head's rows once per query head; "
                 "--selection kv_group shares them)" if config.selection == "query_head" else ""))
    print("speed on this CPU (reference CPU kernels; the byte savings pay off on GPU at long contexts):")
    print(f"  dense        : prefill {prefill:.1f}s, decode {rate:.1f} tokens/s")
    print(f"  HashAttention: prefill {sparse_prefill:.1f}s, decode {sparse_rate:.1f} tokens/s")


if __name__ == "__main__":
    main()
