"""scale: LoRA/QLoRA fine-tuning on one custom loop, from one device to DeepSpeed ZeRO-3 and several nodes."""

import itertools as _itertools
import os as _os
import sys as _sys


def _started_as_trainer(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process is ``scale-train`` or ``python -m scale.train`` (what launchers start)."""
    as_module = any(a == "-m" and b == "scale.train" for a, b in _itertools.pairwise(orig_argv))
    return as_module or (bool(argv) and _os.path.basename(argv[0]) == "scale-train")


if _started_as_trainer(_sys.argv, getattr(_sys, "orig_argv", [])):
    # Before torch, transformers and DeepSpeed are imported (seconds): a SIGTERM then exits 75 at once.
    from scale.utils.signals import exit_on_signal_while_importing

    exit_on_signal_while_importing()
