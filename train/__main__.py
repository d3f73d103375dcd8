"""Command line: ``python -m train {collect,fit,validate,run} [--config FILE] [--flag value ...]``.

``run`` = collect + fit + validate. Every TrainConfig field is a flag; a TOML/JSON config file sets
them too, and flags given on the command line win. Launch with ``torchrun --nproc_per_node N -m train
...`` to shard sequences (collect) and layers (fit, validate) across N processes (gloo on the CPU,
NCCL with ``--device cuda``: one GPU per process).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

import torch

from . import fit as fit_module
from .config import add_config_arguments, config_from_arguments


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no limit), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    helps = {
        "collect": "run the frozen model and write query/key shards",
        "fit": "train the per-layer adapters on the shards",
        "validate": "held-out recall of learned vs LSH vs oracle selection",
        "run": "collect, fit and validate",
    }
    for name, text in helps.items():
        sub = commands.add_parser(name, help=text, description=text)
        add_config_arguments(sub)
        if name in ("fit", "run"):
            sub.add_argument("--resume", action="store_true",
                             help="continue from the checkpoints in --work-dir (same data order and optimizer state)")
            sub.add_argument("--stop-after-steps", type=_non_negative_int, default=0,
                             help="stop this process after N optimizer steps (time-boxed runs; continue with --resume)")
        if name == "validate":
            sub.add_argument("--adapters", default=None, help="adapter directory to validate (default: the run's)")
        sub.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                         help="logging level (default: INFO)")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    config = config_from_arguments(args)
    from .distributed import DistributedContext

    context = DistributedContext(device=config.device)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format=f"%(asctime)s rank{context.rank} %(name)s %(levelname)s %(message)s")
    if config.threads:
        torch.set_num_threads(config.threads)
    launcher = "torchrun --nproc_per_node %d -m train" % context.world_size if context.world_size > 1 else "python -m train"
    fit_module.RUN_COMMAND = " ".join([launcher] + [shlex.quote(a) for a in argv])
    try:
        if args.command in ("collect", "run"):
            from .collect import collect

            collect(config, context)
        if args.command in ("fit", "run"):
            written = fit_module.fit(config, context, resume=args.resume, stop_after_steps=args.stop_after_steps)
            if written is None:
                logging.getLogger("train").info("fit: not all layers finished; rerun with --resume")
                return 0
        if args.command in ("validate", "run"):
            from .validate import validate

            validate(config, context, getattr(args, "adapters", None))
    finally:
        context.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
