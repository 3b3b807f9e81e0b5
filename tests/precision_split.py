"""Test-only shim: ranks whose bf16 probes disagree. Never imported by ``scale/``.

    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m tests.precision_split --config ... \\
        train.mixed_precision=auto

Before ``scale.cli`` runs, the shim replaces ``scale.training.precision.measure_peak_flops`` (the probe behind
``train.mixed_precision: auto``) with a fake that reports bf16 GEMMs at 2x fp32 on rank 0 and 0.5x on every other
rank: ranks that decided on their own measurements would train one model in two dtypes. It also records, per
rank, what the run was built with (``precision_rank<R>.json`` in ``output_dir``: the Accelerator's
``mixed_precision``, ``model.bnb_4bit_compute_dtype``, and how often the fake probe ran there), read by
tests/test_startup.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FP32 = 100e9  # FLOP/s the fake probe reports for float32; bf16 is this x 2 on rank 0, x 0.5 elsewhere


def enable() -> None:
    """Install the fake probe and the per-rank record (idempotent)."""
    import torch

    import scale.training.job
    import scale.training.precision

    if getattr(scale.training.precision.measure_peak_flops, "_scale_split", False):
        return
    calls = [0]

    def fake(device, dtype, seconds=0.4, n=None):
        calls[0] += 1
        rank = int(os.environ.get("RANK", "0"))
        return FP32 if dtype == torch.float32 else FP32 * (2.0 if rank == 0 else 0.5)

    fake._scale_split = True  # type: ignore[attr-defined]
    scale.training.precision.measure_peak_flops = fake
    setup = scale.training.job.setup

    def recorded(cfg):
        job = setup(cfg)
        record = {"mixed_precision": job.acc.mixed_precision, "compute_dtype": cfg.model.bnb_4bit_compute_dtype,
                  "probes": calls[0]}
        Path(cfg.output_dir, f"precision_rank{job.acc.process_index}.json").write_text(json.dumps(record))
        return job

    scale.training.job.setup = recorded


if __name__ == "__main__":  # the training entry point, as `python -m scale.train`, with the shim
    import runpy

    enable()
    import scale.train

    scale.train.setup = scale.training.job.setup  # scale.train imported setup by name
    runpy.run_module("scale.cli", run_name="__main__", alter_sys=True)
