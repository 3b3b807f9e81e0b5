"""The memory planner: the bytes each rank holds in every launch mode, from configs only (meta-device
models, fake-tensor forwards; no weights, no process group). ``scale-plan`` (:mod:`scale.plan`) prints it; the
run's start-up consults it for ``train.micro_batch_size: auto`` (:mod:`scale.planner.autobatch`).

Imports the wings below it (utils, config, loss, data, modeling, objectives); never ``accelerate`` or
``torch.distributed``.
"""
