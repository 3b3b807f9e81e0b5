"""The best checkpoint (``train.keep_best``) and early stopping (``train.early_stopping_patience``). No torch.

    train.keep_best: eval/loss            # or eval/accuracy, eval/gen_exact_match, ... (mode inferred, or
    train.keep_best_mode: auto            #  train.keep_best_mode: min | max)
    train.early_stopping_patience: 3      # stop after 3 evaluations without a better eval/loss

Every evaluation after step 0 is compared with the best so far (:func:`observe`; the step-0 figure is the model
before training, with no checkpoint to keep). An improvement writes a checkpoint of that step (``reason: best``)
even between ``train.save_every`` intervals, and :func:`scale.training.checkpoint.rotate` never deletes it: it does not
count against ``train.save_total_limit``. ``<output_dir>/best.json`` names it (written atomically, after the
checkpoint). The counters live in :class:`scale.training.state.TrainerState`, so a resumed run continues them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scale.config.validation import ConfigError
from scale.config.validation import best_mode
from scale.training.state import TrainerState
from scale.utils.fileio import write_text_atomic

BEST_FILE = "best.json"


def observe(state: TrainerState, metrics: dict[str, Any], metric: str, mode: str = "auto") -> bool:
    """Record the evaluation ``metrics`` of ``state.step`` in ``state``; return whether it is a new best.

    A non-finite value never improves. Ties do not improve (the older checkpoint stays the best).

    Raises:
        ConfigError: ``metric`` is not among ``metrics`` (the run's format does not report it).
    """
    if metric not in metrics:
        raise ConfigError(f"train.keep_best={metric!r} is not an evaluation metric of this run; it reports "
                          f"{sorted(k for k in metrics if isinstance(metrics[k], (int, float)))}")
    value = float(metrics[metric])
    if best_mode(metric, mode) == "min":
        better = math.isfinite(value) and (state.best_metric is None or value < state.best_metric)
    else:
        better = math.isfinite(value) and (state.best_metric is None or value > state.best_metric)
    if better:
        state.best_metric, state.best_step, state.evals_since_best = value, state.step, 0
    else:
        state.evals_since_best += 1
    return better


def check_reported(metric: str | None, reported: set[str]) -> None:
    """``train.keep_best`` names one of the metrics every evaluation of this run reports: checked before step 1,
    so that a metric the run never reports does not stop it at its first evaluation after training started.

    Raises:
        ConfigError: ``metric`` is not in ``reported`` (the message lists them).
    """
    if metric is None or metric in reported:
        return
    why = (" (eval/gen_* metrics need eval.generate_samples > 0)" if metric.startswith("eval/gen_") and
           not any(k.startswith("eval/gen_") for k in reported) else "")
    raise ConfigError(f"train.keep_best={metric!r} is not an evaluation metric of this run{why}; it reports "
                      f"{sorted(reported)}: set train.keep_best to one of them")


def out_of_patience(state: TrainerState, patience: int | None) -> bool:
    """Whether ``patience`` evaluations in a row have not improved the best (``None``: never)."""
    return patience is not None and state.evals_since_best >= patience


def write_best(output_dir: str | Path, state: TrainerState, metric: str) -> Path:
    """``<output_dir>/best.json``: ``{"metric", "value", "step", "checkpoint"}`` of the best evaluation (atomic)."""
    path = Path(output_dir) / BEST_FILE
    checkpoint = Path(output_dir) / "checkpoints" / f"step_{state.best_step:06d}"
    write_text_atomic(path, json.dumps({"metric": metric, "value": state.best_metric, "step": state.best_step,
                                        "checkpoint": str(checkpoint)}))
    return path
