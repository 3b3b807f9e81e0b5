"""Test-only shim: accelerate's FSDP2 on CPU processes (gloo). Never imported by ``scale/``.

    accelerate launch --config_file tests/cpu_fsdp2.yaml -m tests.fsdp_cpu --config configs/train/tiny_cpu.yaml

accelerate 1.15 sets ``DistributedType.FSDP`` only when ``PartialState`` found a GPU-like device
(``AcceleratorState.__init__``: the FSDP branch is inside ``elif self.distributed_type in [MULTI_GPU, ...]``); on a
machine without one, ``Accelerator(cpu=True)`` gets ``MULTI_CPU`` + gloo and an FSDP config silently runs as DDP.
The shim patches ONE thing, ``PartialState.__init__``: after accelerate has started the gloo process group and set
the device to ``cpu`` (its ``MULTI_CPU`` path, unchanged), it relabels the distributed type ``MULTI_GPU`` when
the launch asked for FSDP (``ACCELERATE_USE_FSDP=true``), which is what a GPU machine's ``PartialState`` reports.
``AcceleratorState`` then turns it into ``FSDP`` as on GPUs, and everything after (``fsdp2_prepare_model``,
``fully_shard``, ``get_state_dict``, ``save_state``, the harness's loop) is the GPU path's code, on CPU tensors.

Why after ``__init__`` and not in ``_prepare_backend``: returning ``MULTI_GPU`` from there would skip accelerate's
``MULTI_CPU`` branch that starts the gloo process group (with ``cpu=True`` the GPU branch does not start one either)
and ``set_device`` would index ``torch.cuda.device_count()`` (0 here). Relabelling afterwards changes nothing else.
Checked against accelerate 1.15 (``accelerate/state.py``); ``scale-train`` refuses an FSDP launch that did not
become FSDP, so a shim that stopped working fails loudly (``scale.distributed.launch.build_accelerator``).
"""

from __future__ import annotations

import os


def enable() -> None:
    """Patch ``accelerate.state.PartialState.__init__`` as described above (idempotent)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if getattr(PartialState.__init__, "_scale_fsdp_cpu", False):
        return
    original = PartialState.__init__

    def __init__(self, cpu: bool = False, **kwargs):  # noqa: N807 - the patched constructor
        original(self, cpu, **kwargs)
        fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if fsdp and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.MULTI_GPU  # shared state: what a GPU machine reports

    __init__._scale_fsdp_cpu = True  # type: ignore[attr-defined]
    PartialState.__init__ = __init__


if __name__ == "__main__":  # the training entry point, as `python -m scale.train`, with the shim
    import runpy

    enable()
    runpy.run_module("scale.cli", run_name="__main__", alter_sys=True)
