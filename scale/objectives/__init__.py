"""Training objectives, one file each behind one interface (:class:`scale.objectives.base.Objective`);
:func:`build_objective` is the one place an objective is registered (by its ``loss.objective`` value).

    objective = build_objective(cfg)                  # loss.objective: sft -> the tail loss
    num = objective.loss_step(model, batch, objective.weights(batch))

Imports utils, config, loss, data and modeling; never ``accelerate`` or ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable

from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.objectives.base import Objective
from scale.objectives.grpo import GrpoObjective
from scale.objectives.preference import PreferenceObjective
from scale.objectives.tail import LossSpec

OBJECTIVES: dict[str, Callable[[Config], Objective]] = {
    "sft": LossSpec.from_config,  # cross-entropy over each row's tail (scale.objectives.tail)
    "dpo": PreferenceObjective.from_config,  # preference pairs (scale.objectives.preference): sigmoid | ipo | hinge
    "simpo": PreferenceObjective.from_config,  # reference-free, per-token logps with a target margin
    "orpo": PreferenceObjective.from_config,  # the chosen NLL + the odds-ratio term, reference-free
    "grpo": GrpoObjective.from_config,  # online RL on sampled completions (scale.objectives.grpo): grpo | dr_grpo | ...
}


def build_objective(cfg: Config) -> Objective:
    """The objective ``loss.objective`` names, built from the config.

    Raises:
        ConfigError: an objective that is not registered in :data:`OBJECTIVES`.
        ValueError: a ``loss.criterion`` that cannot be imported (:func:`scale.loss.tail.load_criterion`).
    """
    build = OBJECTIVES.get(cfg.loss.objective)
    if build is None:
        raise ConfigError(f"loss.objective={cfg.loss.objective!r} is not one of {sorted(OBJECTIVES)}")
    return build(cfg)
