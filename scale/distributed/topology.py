"""How many processes a launch starts on this machine, and how many it may: one rank per visible GPU, or (no GPU)
at most ``max(2, CPU cores)`` CPU ranks.

    scale-train --accelerate-config ddp --config default                  # one rank per visible GPU; no GPU: 2
    scale-train --accelerate-config zero3 --num-processes 4 --config default

The shipped GPU topologies (``configs/accelerate/{ddp,zero1,zero2,zero3,zero3_offload,fsdp2}.yaml``) carry
``num_processes: 8`` for ``accelerate launch --config_file`` on an 8-GPU node; ``scale-train --accelerate-config``
replaces it with the visible GPU count (:func:`processes_for`). No torch: the launcher's wrapper imports this module
without starting torch; the GPU count comes from torch only where an NVIDIA or AMD driver is present.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

from scale.config.validation import ConfigError

CPU_RANKS = 2  # ranks of a multi-process launch without a GPU, as configs/accelerate/cpu_*.yaml
GPU_TOPOLOGIES = ("ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload")  # shipped, count from the GPUs


def visible_gpus() -> int:
    """GPUs this process can use: ``torch.cuda.device_count()`` (it honours ``CUDA_VISIBLE_DEVICES``), or 0 without
    torch's import where no GPU driver is installed (no ``/dev/nvidiactl``, ``/dev/kfd`` or ``nvidia-smi``)."""
    if not (Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists() or shutil.which("nvidia-smi")):
        return 0
    import torch

    return torch.cuda.device_count()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as ``taskset`` or a cgroup leaves it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ranks_problem(ranks: int, gpus: int, cores: int) -> str | None:
    """Why ``ranks`` processes on one machine do not fit it, or None: more ranks than visible GPUs (two ranks
    would share a GPU: NCCL refuses, or each holds a second copy), or, without a GPU, more than
    ``max(2, cores)`` CPU ranks (8 ranks on 2 cores time-slice every step)."""
    if ranks < 1:
        return f"{ranks} processes: at least 1"
    if gpus and ranks > gpus:
        return (f"{ranks} processes on this machine but {gpus} GPU{'s' if gpus > 1 else ''} visible: at most one "
                f"process per GPU; use {gpus} (or set CUDA_VISIBLE_DEVICES)")
    if not gpus and ranks > max(CPU_RANKS, cores):
        return (f"{ranks} processes on this machine without a GPU and {cores} CPU cores: at most "
                f"{max(CPU_RANKS, cores)}")
    return None


def processes_for(tree: dict[str, Any], name: str, requested: int | None, gpus: int, cores: int,
                  shipped: bool = True) -> tuple[int, str]:
    """The process count of a launch with the accelerate config ``tree`` and why.

    - ``requested`` (``--num-processes N``) when given;
    - a shipped GPU topology (:data:`GPU_TOPOLOGIES`): the visible GPUs, or :data:`CPU_RANKS` CPU processes
      without a GPU (as the ``cpu_*`` configs);
    - else the YAML's ``num_processes`` (``single``: 1; a multi-node YAML: the total over its machines).

    Args:
        tree: the accelerate config as loaded.
        name: the config's file stem (``ddp``).
        requested: ``--num-processes``, or None.
        gpus: visible GPUs (:func:`visible_gpus`); cores: usable CPU cores (:func:`usable_cores`).
        shipped: the config is one of the package's (``configs/accelerate/``), not the user's own.

    Returns:
        ``(processes over all machines, the reason in words)``.

    Raises:
        ConfigError: the count does not fit this machine (:func:`ranks_problem`), or ``single`` with more than 1.
    """
    machines = int(tree.get("num_machines", 1) or 1)
    if str(tree.get("distributed_type", "NO")).upper() == "NO":
        if requested not in (None, 1):
            raise ConfigError(f"--num-processes {requested}: {name} runs one process; use --accelerate-config ddp "
                              f"(or zero2, zero3) for {requested}")
        return 1, "one process"
    if requested is not None:
        count, why = requested, "--num-processes"
    elif shipped and name in GPU_TOPOLOGIES and machines == 1:
        count, why = ((gpus, f"one per visible GPU ({gpus})") if gpus else
                      (CPU_RANKS, f"no GPU: {CPU_RANKS} CPU processes, as the cpu_* configs"))
    else:
        count, why = int(tree.get("num_processes", 1)), f"num_processes of {name}.yaml"
    problem = ranks_problem(math.ceil(count / machines), gpus, cores)
    if problem:
        raise ConfigError(f"--accelerate-config {name}: {problem}; pass --num-processes N")
    return count, why
