"""Worker of tests/test_resume.py's launch test: in one launch, for each case (a data format and a train split size),
the tiny job uninterrupted with a checkpoint every step, then resumed from the checkpoint before its epoch's last
window, both through ``scale.cli.main`` as ``python -m scale.train`` runs it. Never imported by ``scale/``.

    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m tests.resume_launch OUT

Each job runs in this process one after the other (accelerate's state is reset between them; the process group
stays: ``end_training`` leaves it, this worker destroys it once at the end), so the launch's start-up (~10 s of
imports and the rendezvous on 2 cores) is paid once for every case.
Case ``c`` writes ``OUT/<c>/ref`` and ``OUT/<c>/resumed`` (``metrics.jsonl``, the adapter); the test compares them.
A job that fails raises out of this process, as ``scale-train`` would, and the launch exits non-zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.launching import JOB, PAIRS, ROOT, TINY

# micro-batch 1 x GA 2 x 2 ranks: a global batch of 4 micro-batches. 13 items make windows of 4, 4, 4 and 1 per
# epoch: in the last one rank 0 trains one micro-batch and rank 1, whose shard is one short, repeats its previous
# one as a zero-weight stand-in. Dropout on: a stand-in other than that batch would draw other masks from there on.
SIZES = ["train.micro_batch_size=1", "train.gradient_accumulation_steps=2", "train.max_steps=6", "train.save_every=3",
         "lora.dropout=0.1", "data.eval_size=8", "eval.generate_samples=0", "log.peak_flops=false"]
# name -> (overrides, items in the train split, the step whose checkpoint the resumed run starts from)
ZERO3 = [f"train.deepspeed_config={ROOT / 'configs' / 'deepspeed' / 'zero3.json'}"]
CASES = {
    "rows ddp": ([], 13, 3),
    "pairs ddp": (PAIRS, 13, 3),
    "rows zero3": (ZERO3, 13, 3),
    "pairs zero3": ([*PAIRS, *ZERO3], 13, 3),
}


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def main(out: Path) -> int:
    import torch
    from accelerate.state import PartialState

    from scale.cli import main as scale_train

    PartialState.destroy_process_group = lambda self, group=None: None  # the next job joins the same group
    try:
        return run_cases(out, scale_train)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_cases(out: Path, scale_train) -> int:
    for name, (overrides, items, step) in CASES.items():
        job = ["--config", str(TINY), *JOB, *SIZES, *overrides, f"data.max_train_examples={items}"]
        ref = out / name.replace(" ", "_") / "ref"
        for args in ([f"output_dir={ref}"],
                     [f"output_dir={ref.parent / 'resumed'}", f"train.resume_from={ref}/checkpoints/step_{step:06d}"]):
            code = scale_train([*job, *args])
            if code != 0:
                return code
            _reset()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
