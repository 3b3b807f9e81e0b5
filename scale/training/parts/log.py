"""The log part: where the run's figures go (``metrics.jsonl`` and the trackers,
:class:`scale.training.metrics.MetricsLog`) and what every evaluation generates (``samples.jsonl``,
:class:`scale.training.samples.Generation`), with the check that ``train.keep_best`` names a figure the run reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scale.config.schema import Config
from scale.data.collate import Collator
from scale.data.tasks.preference import Pair, PairCollator
from scale.data.tokenize import Splits
from scale.generation.export import serving_tokenizer
from scale.objectives.preference import PreferenceObjective
from scale.objectives.tail import LossSpec
from scale.training.best import check_reported
from scale.training.evaluate import metric_names
from scale.training.metrics import JsonlSink, MetricsLog
from scale.training.parts.launch import Launch
from scale.training.samples import (SAMPLES_FILE, Generation, Sample, pick_samples, sample_metric_names,
                                    start_samples_file)
from scale.training.state import TrainerState
from scale.training.tracking import start_trackers


def pick_eval_samples(cfg: Config, splits: Splits, spec: LossSpec) -> list[Sample]:
    """The eval rows every evaluation generates from (``eval.generate_samples``; none when 0), once
    ``train.keep_best`` was checked against every figure the run reports (before step 1).

    Raises:
        ConfigError: ``train.keep_best`` names a figure no evaluation reports
            (:func:`scale.training.best.check_reported`).
    """
    samples = pick_samples(splits.eval, cfg.eval.generate_samples, cfg.data.labels, pairs=bool(splits.task.sides)) \
        if cfg.eval.generate_samples else []
    check_reported(cfg.train.keep_best, metric_names(splits.task, spec) | sample_metric_names(samples))
    return samples


def build_log(launch: Launch, cfg: Config, splits: Splits, state: TrainerState) -> MetricsLog:
    """``metrics.jsonl`` and the trackers. A resumed run keeps the history up to its checkpoint and drops what was
    logged after it; the trackers then continue the job's run and get the rows they lack
    (:mod:`scale.training.tracking`). A fresh run logs the data counts and the precision choice once, at step 0."""
    acc, resumed = launch.acc, launch.resume is not None
    sink = JsonlSink(Path(cfg.output_dir) / "metrics.jsonl", acc.is_main_process,
                     keep_until=state.step if resumed else None)
    log = MetricsLog(acc, sink, skip_below=start_trackers(cfg, acc, state))
    if not resumed:
        log.write(0, {**splits.stats, **(launch.precision.metrics() if launch.precision else {})})  # once per run
    return log


def pair_scorer(objective: PreferenceObjective, pad_token_id: int, padding_side: str, device: Any) -> Any:
    """``(model, [chosen, rejected]) -> dict``: one pair collated as training collates it (padded,
    :class:`scale.data.tasks.preference.PairCollator`) and scored by ``objective.pair_scores``."""
    collate = PairCollator(Collator(pad_token_id, padding_side))

    def score(model: torch.nn.Module, pair: list[Any]) -> dict[str, Any]:
        batch = {k: v.to(device) for k, v in collate([Pair(*pair)]).items()}
        return objective.pair_scores(model, batch)[0]

    return score


def build_generation(launch: Launch, cfg: Config, samples: list[Sample], chat: bool,
                     state: TrainerState, objective: Any = None) -> Generation | None:
    """What every evaluation generates (``eval.generate_samples > 0``), or None: the serving tokenizer stops at EOS
    and the trained template's end-of-turn marker (``chat``: a chat template rendered the rows). Under a
    preference ``objective`` each pair's logps and rewards are added (:func:`pair_scorer`)."""
    if not cfg.eval.generate_samples:
        return None
    serving, stops, _ = serving_tokenizer(cfg, chat=chat)
    score = (pair_scorer(objective, serving.pad_token_id, cfg.data.padding_side, launch.acc.device)
             if isinstance(objective, PreferenceObjective) else None)
    gen = Generation(samples, serving, stops, cfg.eval.max_new_tokens, launch.plan.partitioned,
                     Path(cfg.output_dir) / SAMPLES_FILE, score=score)
    start_samples_file(gen.path, launch.acc.is_main_process, state.step if launch.resume is not None else None)
    return gen
