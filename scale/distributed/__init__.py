"""Processes and the Accelerator: how many ranks a machine starts (:mod:`scale.distributed.topology`),
the run's inputs checked before any process group (:mod:`scale.distributed.inputs`), the process group that
survives restarts (:mod:`scale.distributed.rendezvous`), the launch mode: Accelerator, DeepSpeed reconciliation and
the mode plan (:mod:`scale.distributed.launch`), collectives of the start-up (:mod:`scale.distributed.collective`),
sequence parallelism (:mod:`scale.distributed.ulysses`) and a frozen reference model wrapped as the policy is
(:mod:`scale.distributed.frozen`).

Imports utils, config, loss, data and modeling; may import ``accelerate`` and ``torch.distributed``. This face hands
nothing on (``scale-train`` imports :mod:`scale.distributed.topology` before torch).
"""
