"""``python -m hashattention.serve``'s server: an OpenAI-compatible chat completion over HTTP, in-process on CPU."""

import json
import socket
import time
import urllib.request

import pytest
import torch

from hashattention.adapters import HashAdapters
from hashattention.config import HashAttentionConfig
from hashattention.offline_model import load_smollm2
from hashattention.patching import patch
from hashattention.serve import MODEL_NAME, build_parser, start_server

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
NEW_TOKENS = 12


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def wait_until_up(base: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_chat_completion_over_http_equals_generate():
    model, tokenizer = load_smollm2()
    # Small windows and 4x sparsity: the 37-token chat prompt and its answer run sparse.
    patch(model, HashAdapters.from_pretrained(MODEL_NAME),
          HashAttentionConfig(sink_tokens=4, local_tokens=4, sparsity=4, sparse_prompt_tokens=4))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)

    port = free_port()
    server = start_server(model, tokenizer, host="127.0.0.1", port=port, num_blocks=64)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(base)
        reply = post(base + "/v1/chat/completions",
                     {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0})
        assert model.config._attn_implementation == "paged|hashattention"  # the manager is running
    finally:
        server.kill_server()
    assert reply["choices"][0]["message"]["content"] == expected
    assert reply["usage"]["completion_tokens"] == NEW_TOKENS


def test_parser_defaults_and_bad_arguments():
    args = build_parser().parse_args([])
    assert (args.adapters, args.port, args.num_blocks) == (MODEL_NAME, 8000, 256)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "eight"])
