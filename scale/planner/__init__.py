"""The memory planner: the bytes each rank holds in every launch mode, from configs only (meta-device models,
fake-tensor forwards; no weights, no process group). Parameters are counted by :mod:`scale.planner.census`, saved
activations by :mod:`scale.planner.activations`, laid out per launch mode by :mod:`scale.planner.layouts`, and put
together by :mod:`scale.planner.plan` (with :mod:`scale.planner.pairs` for preference jobs and
:mod:`scale.planner.moe` for mixture-of-experts models); :mod:`scale.planner.autobatch` searches the largest
micro-batch that fits. ``scale-plan`` (:mod:`scale.plan`) prints a plan.

The training run consults the planner through this face only, and through one function:
:func:`~scale.planner.autobatch.plan_micro_batch` (``train.micro_batch_size: auto`` and the under-used-GPU line).

Imports the wings below it (utils, config, loss, data, modeling, objectives); never ``accelerate`` or
``torch.distributed``.
"""

from scale.planner.autobatch import MicroBatch, plan_micro_batch

__all__ = ["MicroBatch", "plan_micro_batch"]
