"""``scale-train``: parse the command line, train, and turn the outcome into an exit code.

    scale-train [--config NAME|PATH] [section.key=value ...]        # or --section.key=value (W&B sweeps)
    scale-train --accelerate-config cpu_zero2 --config tiny_cpu          # 2 processes through accelerate launch
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m scale.train --config tiny_cpu

``--config`` and ``--accelerate-config`` take a file or the name of a config shipped with the package
(``scale/configs/{train,accelerate}/NAME.yaml``), so both run from any directory.

Exit codes: 0 trained; 2 (:data:`EXIT_BAD_INPUT`) the config, data, launch or checkpoint was rejected before
training, with one line on stderr naming the fix; 75 (:data:`scale.utils.signals.EXIT_PREEMPTED`) a signal arrived
and a checkpoint was written; 1 anything else (a non-finite loss, a crash).

Under a launcher the message is reported once, by global rank 0 (every rank runs the same checks; a failure of one
rank alone is reported by that rank): ``torchrun``/``accelerate launch`` get it in their error file and show it as
the root cause in the summary they print last; other launchers get it on stderr. The exit code by launcher:

- ``scale-train --accelerate-config``: the job's code (2, 75, 1), and the message is the last line.
- ``deepspeed``: passes a rank's code through (2, 75); its own log lines may follow the message.
- ``accelerate launch`` and ``torchrun``: always 1 when a rank fails (torch elastic's ``ChildFailedError``);
  the message is the ``traceback :`` line of their summary block, followed only by its border.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from scale.config.help import help_text, keys_help
from scale.config.load import load_config
from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.distributed.launcher import OUTCOME_DIR, launch_with_accelerate, without_accelerate_config
from scale.utils.assets import resolve_data
from scale.utils.logs import configure_logging
from scale.utils.signals import EXIT_PREEMPTED, Preempted, Preemption

# torch, transformers and the loop are imported when a job runs (start_fast, main): `scale-train --accelerate-config`
# and `--help` only start a launcher or print, without the ~4 s of CPU their import costs. The imports of scale
# modules inside functions below are those (each marked "deferred"), listed in tests/test_layering.py.
EXIT_BAD_INPUT = 2  # config, data, launch or checkpoint rejected before training; the message names the fix

logger = logging.getLogger("scale.train")


def _error(e: BaseException, code: int = EXIT_BAD_INPUT, echo: bool = True) -> None:
    """Report a failure once: rank 0 prints it (a rank-local failure prints on its own rank); every rank also
    leaves it for the launcher (torch elastic's error file) and for ``--accelerate-config`` (the exit code).
    ``echo=False``: already logged (pre-emption), only left for the launcher."""
    rank = int(os.environ.get("RANK", "0"))
    kind = "pre-empted" if code == EXIT_PREEMPTED else "error"
    line = f"scale-train: {kind}: {type(e).__name__}: {e}" + (f" (rank {rank})" if rank else "")
    mine = rank == 0 or getattr(e, "rank_local", False)  # the other ranks raised the same error as rank 0
    outcome = os.environ.get(OUTCOME_DIR)
    if outcome:
        with contextlib.suppress(OSError):
            Path(outcome, f"rank_{rank}.json").write_text(json.dumps({"code": code, "line": line, "rank": rank}))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun and accelerate launch
    if error_file:  # shown as each rank's "traceback" in the summary the launcher prints last
        # torch elastic names the failure with the earliest timestamp the root cause: rank 0's message, once. The
        # timestamps are whole seconds and rank 0 can reach this a second or more after the others (a loaded
        # machine): the other ranks' stamps lie a minute ahead so that rank 0's always comes first.
        text = line if mine else f"scale-train: error: the same as rank 0's (rank {rank})"
        data = {"message": {"message": text, "extraInfo": {"py_callstack": text,
                                                           "timestamp": str(int(time.time()) + 60 * (not mine))}}}
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps(data))
    if echo and mine and not outcome and not error_file:
        sys.stderr.write(line + "\n")
    if not mine:  # under any launcher: the `deepspeed` launcher kills rank 0 too once another rank exits first,
        # before it printed the message (seen once a rank reached a config error in ~0.2 s: scale.cli imports no torch).
        # The launcher stops this rank once rank 0 exits: leave at once with the same code, no second traceback
        # (the start-up SIGTERM handler of scale.utils.signals would raise Preempted in the middle of this sleep).
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda *_: os._exit(code))
        time.sleep(1.0)  # let rank 0 exit first with its code: the launcher then stops the others


OWN_OPTIONS = ("--config", "--accelerate-config", "--local_rank", "--local-rank", "--help", "--show-rows",
               "--num-processes", "--num_processes")


def override_form(argv: list[str]) -> list[str]:
    """``--section.key=value`` (what ``wandb agent``'s default command passes: ``${args}``) as
    ``section.key=value``; the CLI's own options and every other argument are left as they are."""
    return [a[2:] if a.startswith("--") and "=" in a and a.split("=", 1)[0] not in OWN_OPTIONS else a for a in argv]


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``scale-train`` (:func:`parse_args`)."""
    parser = argparse.ArgumentParser(prog="scale-train", description=help_text(__doc__), add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-h", "--help", nargs="?", const="", default=None, metavar="SECTION|KEY",
                        help="this help and every config key (type, default, one line); --help optim: one section "
                             "in full, --help optim.lr: one key, --help trl: TRL/transformers names -> scale keys")
    parser.add_argument("--config", default=None, help="training YAML, or a shipped config's name such as tiny_cpu "
                                                       "(default: default)")
    parser.add_argument("--accelerate-config", default=None, metavar="NAME|PATH",
                        help="start the job through `accelerate launch` with this accelerate config (a shipped name "
                             "such as cpu_zero2, ddp, zero3, or a YAML; its DeepSpeed JSON is read relative to it); "
                             "the exit code is the job's")
    parser.add_argument("--num-processes", "--num_processes", type=int, default=None, metavar="N",
                        help="with --accelerate-config: start N processes (default: one per visible GPU for the "
                             "shipped GPU topologies, 2 CPU processes without a GPU, else the YAML's num_processes); "
                             "more than this machine's GPUs (or, without a GPU, max(2, CPU cores)) is refused")
    parser.add_argument("--show-rows", type=int, default=None, metavar="N",
                        help="print the first N train rows as the model reads them, trained tokens between [[ and ]], "
                             "and exit (nothing is trained or written)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.max_steps=50")
    # The `deepspeed` launcher appends --local_rank=N; the rank is read from LOCAL_RANK in the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--config PATH`` and the dotted overrides (``key=value`` or ``--key=value``), before and after it."""
    argv = override_form(sys.argv[1:] if argv is None else list(argv))
    return build_parser().parse_intermixed_args(argv)  # overrides may come before and after --config


def print_help(topic: str) -> int:
    """``scale-train --help [TOPIC]`` on stdout (:func:`scale.config.help.keys_help`); return the exit code."""
    try:
        text = keys_help(topic) if topic else build_parser().format_help() + "\n" + keys_help()
    except ConfigError as e:
        _error(e)
        return EXIT_BAD_INPUT
    sys.stdout.write(text)
    return 0


def bad_input_errors() -> tuple[type[Exception], ...]:
    """The errors that mean bad input (exit :data:`EXIT_BAD_INPUT`): their message names the fix."""
    from scale.data.read import DataError  # deferred: scale.data imports torch
    from scale.distributed.launch import LaunchError  # deferred: accelerate
    from scale.training.checkpoint import CheckpointError  # deferred: torch (module comment above)

    return (ConfigError, DataError, LaunchError, CheckpointError)


def check_names(cfg: Config) -> None:
    """The paths the config names, checked from the names alone before the model libraries are imported (bitsandbytes
    logs a kernel notice at import, which would precede the one-line error): ``model.name_or_path``/``model.tokenizer``
    (:func:`scale.distributed.inputs.check_model_paths`), ``data.path``/``data.eval_path``
    (:func:`scale.data.mixing.check_sources`) and a ``train.resume_from`` directory
    (:func:`scale.training.checkpoint.resolve_resume`). The run checks them again where it uses them.

    Raises:
        ConfigError, DataError, CheckpointError: a path that does not exist, or is not what the key needs.
    """
    from scale.data.mixing import check_sources  # deferred: scale.data imports torch
    from scale.distributed.inputs import check_model_paths  # deferred: torch
    from scale.training.checkpoint import resolve_resume  # deferred: torch (module comment above)

    check_model_paths(cfg)
    check_sources(cfg.data)
    resolve_resume(cfg.train.resume_from, cfg.output_dir)


def start_fast(cfg: Config) -> None:
    """Start-up of a process that runs one job: keep bitsandbytes out unless the run can need it, import the
    libraries with the cyclic garbage collector paused, then freeze what they created.

    Measured on the tiny job (2 steps), one process on 2 CPU cores: 13.5 s -> 9.8 s; a DDP launch 25.1 -> 17.3 s.

    - peft and transformers import bitsandbytes whenever it is installed, and bitsandbytes 0.50 wraps its CPU
      kernels in ``torch.compile`` at import, which imports inductor (~3 s of CPU). A run that quantizes nothing
      (:func:`scale.modeling.build.needs_bitsandbytes`) gets ``sys.modules["bitsandbytes"] = None``
      (:func:`scale.modeling.build.keep_bitsandbytes_out`): peft and transformers then treat it as not installed.
    - The imports allocate millions of objects that live as long as the process; the collector would traverse
      them again and again while they load (~1 s), and at every full collection afterwards (``gc.freeze``, as
      https://docs.python.org/3/library/gc.html#gc.freeze suggests for such start-up objects).

    - DeepSpeed's Muon module, which every ZeRO engine start imports, is imported with its ``torch.compile``
      deferred (:func:`import_with_lazy_compile`): a ZeRO-2 launch of the tiny job 17.9 -> 15.8 s, 28.7 -> 25.1
      CPU-s (2 runs each, 2026-12-02).

    Only for a process of its own (:func:`cli`): an in-process caller may train QLoRA next, and freezing would keep
    its garbage.
    """
    gc.disable()
    try:
        from scale.modeling.build import keep_bitsandbytes_out  # deferred: imported with the collector paused

        keep_bitsandbytes_out(cfg.model)
        import accelerate  # noqa: F401
        import peft  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        import scale.train  # noqa: F401 - deferred: the loop's imports, with the collector paused
        if cfg.train.deepspeed_config is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            import deepspeed  # noqa: F401

            # Every ZeRO engine start imports DeepSpeed's Muon optimizer (is_zero_supported_optimizer), whose
            # @torch.compile decorators import inductor: ~2 s of CPU per rank for an optimizer this harness never
            # builds. Imported here with each compile deferred to its function's first call.
            import_with_lazy_compile("deepspeed.runtime.zero.muon.muon_optimizer")
    finally:
        gc.enable()
    gc.freeze()


def import_with_lazy_compile(module: str) -> None:
    """Import ``module`` with ``torch.compile(fn, **kwargs)`` deferred to ``fn``'s first call: the compiled
    function is the same, built when first used instead of at import (which imports inductor, ~2 s of CPU).

    Only ``torch.compile`` applied to a function at import is affected; ``torch.compile`` itself is restored before
    this returns. A module that cannot be imported (an older DeepSpeed without it) is left alone.
    """
    import functools
    import importlib

    import torch

    compile_now = torch.compile

    def compile_later(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=...) form
            return lambda fn: compile_later(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **kwargs)
            return compiled(*args, **kw)

        return first_call_compiles

    torch.compile = compile_later
    try:
        importlib.import_module(module)
    except ImportError:
        pass
    finally:
        torch.compile = compile_now


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """``scale-train [--config PATH] [section.key=value ...]``: parse, train; return the exit code.

    ``own_process``: this process runs this job and nothing else (:func:`cli`), so it may start the way
    :func:`start_fast` does."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.help is not None:
        return print_help(args.help)
    if args.accelerate_config is not None:
        try:
            return launch_with_accelerate(args.accelerate_config, without_accelerate_config(argv),
                                          args.num_processes)
        except ConfigError as e:
            _error(e)
            return EXIT_BAD_INPUT
    if args.num_processes is not None:
        _error(ConfigError("--num-processes needs --accelerate-config (the launcher starts the processes), e.g. "
                           "scale-train --accelerate-config ddp --num-processes 2"))
        return EXIT_BAD_INPUT
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        _error(e)
        return EXIT_BAD_INPUT
    configure_logging(dict(os.environ), uses_deepspeed=cfg.train.deepspeed_config is not None)
    if args.show_rows is not None:  # the data path only: the loop is not imported
        try:
            show_rows(cfg, args.show_rows)
        except bad_input_errors() as e:
            _error(e)
            return EXIT_BAD_INPUT
        return 0
    try:
        check_names(cfg)  # before transformers, peft and bitsandbytes print anything
    except bad_input_errors() as e:
        _error(e)
        return EXIT_BAD_INPUT
    if own_process:
        start_fast(cfg)  # first: the imports below run with the collector paused
    from scale.train import run  # deferred: after start_fast
    from scale.training.commit import NonFiniteError  # deferred: after start_fast

    bad_input = bad_input_errors()
    preemption = Preemption()
    preemption.install()
    try:
        run(cfg, preemption)
    except Preempted as e:
        logger.warning("%s; exit code %d", e, EXIT_PREEMPTED)
        _error(e, EXIT_PREEMPTED, echo=False)
        return EXIT_PREEMPTED
    except bad_input as e:  # bad input: the message is the help
        _error(e)
        return EXIT_BAD_INPUT
    except NonFiniteError as e:
        _error(e, 1)
        return 1
    finally:
        preemption.uninstall()
    return 0


def show_rows(cfg: Any, n: int) -> None:
    """``scale-train --show-rows N``: the first ``n`` train rows (split and order as the run's data pipeline
    builds them), each with its data-file row, its token counts and its text, trained tokens between ``[[`` and
    ``]]``; printed on stdout. Nothing is trained or written.

    A ``data.eval_size`` the data cannot hold does not hide the rows (one looks at them to choose it): they are
    shown as split with one held-out row, and the run's error follows them on stderr.

    Raises:
        DataError, ConfigError: as the run would raise them (except for ``data.eval_size``).
    """
    import dataclasses

    from scale.data.read import DataError  # deferred: scale.data imports torch
    from scale.data.tokenize import (build_splits, removed_lines, show_example, show_legend,  # deferred: torch
                                     stats_line)
    from scale.modeling.build import load_tokenizer  # deferred: transformers

    tokenizer = load_tokenizer(cfg.model)
    path = resolve_data(cfg.data.path)
    problem = None
    try:
        splits = build_splits(cfg.data, cfg.loss, tokenizer, path, cfg.train.seed)
    except DataError as e:
        try:  # the same with the smallest eval split: if that builds, eval_size was what did not fit
            splits = build_splits(dataclasses.replace(cfg.data, eval_size=1), cfg.loss, tokenizer, path, cfg.train.seed)
        except DataError:
            raise e from None
        problem = e
    sys.stdout.write(f"format={splits.format}; {show_legend()}\ndata: {stats_line(splits.stats)}\n")
    for line in removed_lines(splits.stats, cfg.data, splits.task.unit):
        sys.stdout.write(f"data: {line}\n")
    sides = splits.task.sides  # a preference pair is two examples: both are shown, named
    for k, e in enumerate(splits.train[:n * max(len(sides), 1)]):
        trained = sum(e.tail_flags())
        side = f" ({sides[k % len(sides)]})" if sides else ""
        sys.stdout.write(f"--- data-file row {e.row}{side}: {len(e.input_ids)} tokens, {trained} trained\n"
                         f"{show_example(tokenizer, e)}\n")
    sys.stdout.flush()
    if problem is not None:
        sys.stderr.write(f"scale-train: note: rows shown with data.eval_size=1; a run would stop: {problem}\n")


def cli() -> None:
    """Console entry point: :func:`main`, then a clean process exit.

    torch 2.13 + gloo aborts 10-25% of multi-process runs at interpreter exit ("terminate called without an
    active exception", pytorch/pytorch#190489: a gloo thread frees a tensor during finalization). We end
    the process group and collect garbage while the interpreter is whole, flush, and leave with
    ``os._exit`` so finalization never runs. Trackers were already closed by ``end_training()``.

    Otherwise (a finished run: ``end_training()`` already ended the process group) the interpreter exits
    normally, atexit handlers included, after ``gc.freeze()``: its finalization then skips the garbage
    collections over every object torch, transformers and peft created, which took 1.5-4 s per process.
    """
    code = main(own_process=True)
    torch = sys.modules.get("torch")  # not imported by a launcher's wrapper (--accelerate-config) or --help
    distributed = torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        torch.distributed.destroy_process_group()
    gc.collect()
    gc.freeze()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
