"""The pieces of the training loop (:mod:`scale.train`) and the run's assembly: the progress a
checkpoint carries (:mod:`scale.training.state`), the learning-rate schedule, precision, metrics and trackers, the
best checkpoint, evaluation and samples, accumulation windows (:mod:`scale.training.windows`), when a step is
applied (:mod:`scale.training.commit`), checkpoints (:mod:`scale.training.checkpoint`), the parts a run is built
from (:mod:`scale.training.parts`), the start-up lines and the job (:func:`scale.training.job.setup`).

Imports utils, config, loss, data, modeling, objectives, distributed and generation, and the planner only through
its face (:func:`scale.planner.plan_micro_batch`); may import ``accelerate`` and ``torch.distributed``.
"""
