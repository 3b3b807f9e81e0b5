"""What autograd saves on each rank for one sequence-parallel micro-batch: run under ``accelerate launch`` with
``configs/accelerate/cpu_zero2.yaml`` (2 processes) by ``tests/test_plan.py``, against ``scale-plan``'s SP columns.

    accelerate launch --config_file configs/accelerate/cpu_zero2.yaml tests/sp_census.py OUT.json --config ... \\
        train.sequence_parallel_size=2 --case NAME ROWS LENGTH TAIL [--case ...]

The job is set up as ``scale-train`` sets it up (:func:`scale.training.job.setup`: DeepSpeed Ulysses installed, the
model prepared); each case is ``ROWS`` examples of ``LENGTH`` tokens whose last ``TAIL`` tokens are trained, cut into
this rank's shard by the product's :func:`scale.data.sequence.shard_rows`, and one
:meth:`scale.objectives.tail.LossSpec.loss_step` runs on it under the sharded attention with ``saved_tensors_hooks``
counting distinct storages (parameters excluded), with gradient checkpointing as configured and then turned off. Each
rank writes ``OUT.<name>.<rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from scale.config.load import load_config
from scale.data import Example
from scale.data.sequence import shard_rows
from scale.distributed.ulysses import sharded
from scale.training.job import setup


def saved_bytes(model: torch.nn.Module, batch: dict, spec) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with sharded(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        spec.loss_step(model, batch, spec.weights(batch))
    return sum(seen.values())


def main() -> None:
    out, rest = Path(sys.argv[1]), sys.argv[2:]
    cases, args = [], []
    while rest:
        if rest[0] == "--case":
            cases.append((rest[1], int(rest[2]), int(rest[3]), int(rest[4])))
            rest = rest[5:]
        else:
            args.append(rest.pop(0))
    config = args[args.index("--config") + 1]
    overrides = [a for a in args if a not in ("--config", config)]
    job = setup(load_config(config, [*overrides, f"output_dir={out.parent / 'run'}"]))
    seq, base = job.sequence, job.acc.unwrap_model(job.model).get_base_model()
    g = torch.Generator().manual_seed(0)
    for name, rows, length, tail in cases:
        examples = [[Example(torch.randint(3, 400, (length,), generator=g).tolist(), tail, row=i)] for i in range(rows)]
        batch = {k: v.to(job.acc.device) for k, v in shard_rows(examples, seq.rank, seq.size, 0).items()}
        counts = {"checkpointing_on": saved_bytes(job.model, batch, job.objective)}
        base.gradient_checkpointing_disable()
        counts["checkpointing_off"] = saved_bytes(job.model, batch, job.objective)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        record = {"rank": seq.rank, "size": seq.size, "tail_here": int(batch["tail_mask"].sum()), **counts}
        Path(f"{out}.{name}.{job.acc.process_index}.json").write_text(json.dumps(record))
    job.acc.end_training()


if __name__ == "__main__":
    main()
