"""Serve a HashAttention model over HTTP: transformers' OpenAI-compatible server, continuous batching.

    python -m hashattention.serve --port 8000          # offline SmolLM2-135M-Instruct + shipped adapters
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

The model is loaded and patched here (:func:`hashattention.patch`), then handed to ``transformers
serve`` in the same process (its ``Serve`` class, with ``--continuous-batching``): requests run
through the continuous batching manager with ``"paged|hashattention"``
(:mod:`hashattention.paged_attention`). The server is pinned to this one model; requests may
omit ``"model"`` or give :data:`MODEL_NAME`. Needs transformers' serving extras (``fastapi``,
``uvicorn``, ``openai``: ``pip install ".[serve]"`` or requirements/test.txt).
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from .adapters import HashAdapters
from .config import HashAttentionConfig

MODEL_NAME = "smollm2-135m-instruct"
#: Continuous batching's KV cache on the CPU: transformers would otherwise size it to 90% of free RAM.
DEFAULT_BLOCKS = 256
DEFAULT_BLOCK_SIZE = 32


def start_server(model, tokenizer, name: str = MODEL_NAME, host: str = "localhost", port: int = 8000,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: Optional[int] = DEFAULT_BLOCKS,
                 max_batch_tokens: Optional[int] = None):
    """Start ``transformers serve`` on a background thread, serving ``model`` as ``name``.

    Args:
        model: a causal LM, patched or not (a patched one runs HashAttention).
        tokenizer: its tokenizer (chat template included).
        name: the model name of the API (``"model"`` in requests, ``/v1/models``).
        host, port: where to listen.
        block_size, num_blocks, max_batch_tokens: the continuous batching cache (None: transformers'
            choice from free memory).

    Returns:
        transformers' ``Serve`` object; ``.kill_server()`` stops it.
    """
    from transformers.cli.serve import Serve
    from transformers.cli.serving.model_manager import TimedModel

    server = Serve(
        continuous_batching=True, host=host, port=port, cb_block_size=block_size, cb_num_blocks=num_blocks,
        cb_max_batch_tokens=max_batch_tokens, non_blocking=True,
    )
    # transformers loads the models it serves by hub id; this one is already in memory. Registered
    # under the key its loader looks up, with no idle timeout, and pinned as the only model.
    manager = server._model_manager
    manager.loaded_models[manager.process_model_name(name)] = TimedModel(model, timeout_seconds=-1,
                                                                         processor=tokenizer)
    manager.force_model = name
    return server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hashattention.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", default=MODEL_NAME,
                        help="adapters directory or shipped name (default: %(default)s, for the offline SmolLM2)")
    parser.add_argument("--sparsity", type=float, default=None, help="attend 1/sparsity of the keys (default 16)")
    parser.add_argument("--budget-tokens", type=int, default=None, help="attend this many keys instead")
    parser.add_argument("--sink-tokens", type=int, default=128)
    parser.add_argument("--local-tokens", type=int, default=128)
    parser.add_argument("--dense", action="store_true", help="serve the unpatched model (for comparison)")
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cpu", help="torch device of the model (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="KV cache block size in tokens")
    parser.add_argument("--num-blocks", type=int, default=DEFAULT_BLOCKS,
                        help="KV cache blocks (0: size the cache from free memory)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    # Every argument is checked before the model loads.
    config = HashAttentionConfig(sink_tokens=args.sink_tokens, local_tokens=args.local_tokens,
                                 sparsity=args.sparsity, budget_tokens=args.budget_tokens)
    if args.port < 0 or args.port > 65535:
        raise SystemExit(f"--port must be in [0, 65535], got {args.port}")
    if args.num_blocks < 0:
        raise SystemExit(f"--num-blocks must be >= 0, got {args.num_blocks}")
    device = torch.device(args.device)

    from .offline_model import load_smollm2
    from .patching import patch

    model, tokenizer = load_smollm2()
    model.to(device)
    if not args.dense:
        patch(model, HashAdapters.from_pretrained(args.adapters), config)
        print(f"HashAttention: {config.describe()}")
    server = start_server(model, tokenizer, host=args.host, port=args.port, block_size=args.block_size,
                          num_blocks=args.num_blocks or None)
    print(f"serving {MODEL_NAME} on http://{args.host}:{args.port}/v1/chat/completions (Ctrl-C stops)")
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.kill_server()


if __name__ == "__main__":
    main()
