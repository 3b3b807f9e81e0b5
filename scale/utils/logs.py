"""Log lines of every ``scale-*`` command: one format, third-party notices said plainly, library noise dropped.

``scale-train``, ``scale-export`` and ``scale-generate`` call :func:`configure_logging` first thing, before
transformers, peft or bitsandbytes is imported (their import-time notices then go through its filters, and the
progress-bar switches are read at import). No scale imports: every command may use it.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

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


# Third-party start-up notices that say nothing is wrong, rewritten as INFO lines that say what they mean:
# (logger name prefix, start of the message, the line instead).
NOTICES = (
    # bitsandbytes 0.50 on an AVX512-BF16 CPU tries the hub kernel first; its built-in CPU kernel runs instead. The
    # advice to `pip install kernels` is wrong here: kernels would then download from the model hub (STACK.md).
    ("bitsandbytes", "Failed to load CPU gemm_4bit_forward from kernels-community",
     "bitsandbytes: 4-bit GEMMs use its built-in CPU kernel (the hub kernel is not used)"),
    # DeepSpeed on a machine without a GPU: the CPU accelerator is what runs (gloo), as intended.
    ("DeepSpeed", "Setting accelerator to CPU", "DeepSpeed runs on the CPU accelerator (no GPU found)"),
)


class _Notices(logging.Filter):
    """Rewrite the :data:`NOTICES` as INFO records with their plain meaning; every other record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        for prefix, start, instead in NOTICES:
            if record.name.startswith(prefix) and str(record.msg).startswith(start):
                record.msg, record.args, record.levelno, record.levelname = instead, (), logging.INFO, "INFO"
        return True


def configure_logging(env: dict[str, str], uses_deepspeed: bool = False) -> None:
    """Our log lines on stderr; third-party warnings once per run, on the main rank.

    - Every rank of a launch imports the same libraries and prints the same warnings (a bitsandbytes kernel
      notice, a transformers deprecation): ranks other than 0 keep only third-party errors.
    - DeepSpeed's logger talks in runs that do not use DeepSpeed (transformers and peft import it to probe
      for ZeRO-3, and it announces "Setting accelerator to CPU"): it keeps only errors unless the run uses
      DeepSpeed. A filter, not a level: DeepSpeed resets its logger's level when it is imported.
    - Library warnings no user can act on are dropped (:func:`ignore_known_warnings`).
    - Start-up notices that are not problems (:data:`NOTICES`) become INFO lines saying what they mean; accelerate's
      per-file checkpoint lines are dropped (the loop logs one line per checkpoint).
    - Where stderr is not a terminal (a log file), the progress bars of datasets, transformers and the hub are off
      (``HF_DATASETS_DISABLE_PROGRESS_BARS``, ``HF_HUB_DISABLE_PROGRESS_BARS``; transformers reads them at import,
      so call this before importing it): a redrawn bar makes kilobyte lines there (transformers' "Writing model
      shards" in ``scale-export``); the loop writes plain lines instead (:func:`scale.training.metrics.plain_progress`).

    Args:
        env: the environment to read (``RANK``, ``ACCELERATE_USE_DEEPSPEED``, ``SCALE_PROGRESS``); the progress-bar
            switches are set in ``os.environ`` itself (the libraries read it).
        uses_deepspeed: the run trains with DeepSpeed (its logger then keeps its warnings).
    """
    logging.basicConfig(format=LOG_FORMAT, level=logging.INFO)
    for noisy in ("httpx", "urllib3", "datasets", "filelock", "accelerate.checkpointing", "accelerate.accelerator"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()) and env.get("SCALE_PROGRESS") != "bar":
        for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
            os.environ.setdefault(name, "1")
        if "transformers" in sys.modules:  # imported already: it read the variable at import (its bars' switch)
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    notices = _Notices()
    for handler in logging.getLogger().handlers:
        handler.addFilter(notices)
    logging.getLogger("DeepSpeed").addFilter(notices)  # it has its own handler and does not propagate
    ignore_known_warnings()
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


def ignore_known_warnings() -> None:
    """Drop the library warnings that every run would print and no user can act on.

    peft calls transformers' deprecated ``is_gradient_checkpointing`` on every model it wraps (transformers 5.x
    ``FutureWarning``, printed with its ``warnings.warn(`` source line; not ours to fix).
    """
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
