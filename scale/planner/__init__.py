"""The memory planner: the bytes each rank holds in every launch mode, from configs only (meta-device models,
fake-tensor forwards; no weights, no process group). Parameters are counted by :mod:`scale.planner.census`, saved
activations by :mod:`scale.planner.activations`, laid out per launch mode by :mod:`scale.planner.layouts`, and put
together by :mod:`scale.planner.plan` (with :mod:`scale.planner.pairs` for preference jobs and
:mod:`scale.planner.moe` for mixture-of-experts models); :mod:`scale.planner.autobatch` searches the largest
micro-batch that fits. ``scale-plan`` (:mod:`scale.plan`) prints a plan.

Imports the wings below it (utils, config, loss, data, modeling, objectives); never ``accelerate`` or
``torch.distributed``.
"""
