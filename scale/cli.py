"""``scale-train``: parse the command line, train, and turn the outcome into an exit code.

    scale-train [--config PATH] [section.key=value ...]
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m scale.train --config configs/train/tiny_cpu.yaml

Exit codes: 0 trained; 2 (:data:`EXIT_BAD_INPUT`) the config, data, launch or checkpoint was rejected before
training, with one line on stderr naming the fix; 75 (:data:`scale.signals.EXIT_PREEMPTED`) a signal arrived
and a checkpoint was written; 1 anything else (a non-finite loss, a crash).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import warnings

import torch

from scale.checkpoint import CheckpointError
from scale.config import ConfigError, load_config
from scale.data import DataError
from scale.launch import LaunchError
from scale.signals import EXIT_PREEMPTED, Preempted, Preemption
from scale.train import NonFiniteError, run

EXIT_BAD_INPUT = 2  # config, data, launch or checkpoint rejected before training; the message names the fix
BAD_INPUT = (ConfigError, DataError, LaunchError, CheckpointError)

logger = logging.getLogger("scale.train")


def _error(e: BaseException) -> None:
    sys.stderr.write(f"scale-train: error: {type(e).__name__}: {e}\n")


THIRD_PARTY = ("transformers", "peft", "accelerate", "datasets", "bitsandbytes", "torch", "DeepSpeed", "wandb")


class _ErrorsOnly(logging.Filter):
    """Drop records below ERROR from the named loggers and their children (a logger's own filters do not see
    records propagated from its children, so this sits on the handlers too)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        quiet = any(record.name == n or record.name.startswith(n + ".") for n in self.names)
        return not quiet or record.levelno >= logging.ERROR


def configure_logging(env: dict[str, str], uses_deepspeed: bool = False) -> None:
    """Our log lines on stderr; third-party warnings once per run, on the main rank.

    - Every rank of a launch imports the same libraries and prints the same warnings (a bitsandbytes kernel
      notice, a transformers deprecation): ranks other than 0 keep only third-party errors.
    - DeepSpeed's logger talks in runs that do not use DeepSpeed (transformers and peft import it to probe
      for ZeRO-3, and it announces "Setting accelerator to CPU"): it keeps only errors unless the run uses
      DeepSpeed. A filter, not a level: DeepSpeed resets its logger's level when it is imported.
    - peft calls transformers' deprecated ``is_gradient_checkpointing`` on every model it wraps (transformers 5.x
      FutureWarning, not ours to fix): ignored.
    """
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    uses_deepspeed = uses_deepspeed or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    main_rank = env.get("RANK", "0") == "0"
    quiet = tuple(n for n in THIRD_PARTY if not main_rank or (n == "DeepSpeed" and not uses_deepspeed))
    if quiet:
        errors_only = _ErrorsOnly(quiet)
        for handler in logging.getLogger().handlers:
            handler.addFilter(errors_only)
        logging.getLogger("DeepSpeed").addFilter(errors_only)  # it does not propagate: it has its own handler
    if not main_rank:
        warnings.filterwarnings("ignore")  # python warnings come from libraries; rank 0 shows them


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--config PATH`` and the dotted overrides, which may come before and after it."""
    parser = argparse.ArgumentParser(prog="scale-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="training YAML (default: configs/train/default.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.max_steps=50")
    # The `deepspeed` launcher appends --local_rank=N; the rank is read from LOCAL_RANK in the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``scale-train [--config PATH] [section.key=value ...]``: parse, train; return the exit code."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        _error(e)
        return EXIT_BAD_INPUT
    configure_logging(dict(os.environ), uses_deepspeed=cfg.train.deepspeed_config is not None)
    preemption = Preemption()
    preemption.install()
    try:
        run(cfg, preemption)
    except Preempted as e:
        logger.warning("%s; exit code %d", e, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    except BAD_INPUT as e:  # bad input: the message is the help
        _error(e)
        return EXIT_BAD_INPUT
    except NonFiniteError as e:
        _error(e)
        return 1
    finally:
        preemption.uninstall()
    return 0


def cli() -> None:
    """Console entry point: :func:`main`, then a clean process exit.

    torch 2.13 + gloo aborts 10-25% of multi-process runs at interpreter exit ("terminate called without an
    active exception", pytorch/pytorch#190489: a gloo thread frees a tensor during finalization). We end
    the process group and collect garbage while the interpreter is whole, flush, and leave with
    ``os._exit`` so finalization never runs. Trackers were already closed by ``end_training()``.
    """
    code = main()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        torch.distributed.destroy_process_group()
    gc.collect()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
