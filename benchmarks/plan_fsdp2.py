"""``scale-plan``'s FSDP2 rows against what each FSDP2 rank really holds, on 2 CPU processes.

    python benchmarks/plan_fsdp2.py [--shapes tiny,odd,tiny-qlora,smollm2-135m]

For each model shape of ``tests/test_plan.py`` (the tiny Llama of tiny_cpu.yaml; one with odd sizes, whose dim-0
shards are uneven; a tiny QLoRA model with fp32 quant storage; SmolLM2-135M's shape with random weights; and
``smollm2-qlora``, a saved directory of SmolLM2's geometry with 2 of its 30 layers loaded as NF4 with bf16 storage
and compute, as ``tests/test_zero3_directory.py`` builds it) it runs
``tests/plan_census.py`` under ``accelerate launch --config_file tests/cpu_fsdp2.yaml`` (accelerate's own FSDP2
preparation through the test-only shim ``tests/fsdp_cpu.py``), which counts the storages each rank holds right
before its second optimizer step, and compares them with :func:`scale.planner.layouts.predict_mode` (``fsdp2``), row by
row and rank by rank. Exits 1 unless every row is equal to the byte. Not a CI test (4 launches, ~2 minutes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/plan_fsdp2.py`: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale.planner import layouts as LY  # noqa: E402
from tests.test_plan import NO_ACTS, SHAPES, STATES, planned, run_census, smollm2_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,odd,tiny-qlora,smollm2-135m,smollm2-qlora",
                        help=f"subset of {[*SHAPES, 'smollm2-qlora']}")
    args = parser.parse_args()
    ok = True
    sys.stdout.write(f"| shape | rank | {' | '.join(STATES)} | equal |\n|---|---|{'---|' * len(STATES)}---|\n")
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            overrides = SHAPES.get(shape)
            if shape == "smollm2-qlora":
                import transformers

                from tests.launching import from_directory
                from tests.test_zero3_directory import SMOLLM2_SHAPE

                transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(Path(tmp) / "m")
                overrides = [*from_directory(Path(tmp) / "m"), "model.quantize_4bit=true", "model.dtype=bfloat16",
                             "model.bnb_4bit_compute_dtype=bfloat16", "model.bnb_4bit_quant_storage=bfloat16",
                             "train.micro_batch_size=1", "data.max_length=16"]
            elif overrides is None:  # as tests/test_plan.py: SmolLM2's config, one short row
                overrides = [f"model.name_or_path={smollm2_dir(Path(tmp))}", "train.micro_batch_size=1",
                             "data.max_length=16"]
            counts = run_census("fsdp2", {shape: overrides}, Path(tmp) / "census.json")[shape]
            cfg, hf, params = planned(overrides)
            for c in counts:
                assert c["mode"] == "fsdp", c["mode"]
                r = LY.predict_mode(cfg, params, NO_ACTS, "fsdp2", c["world"], hf, rank=c["rank"])
                cells = [(getattr(r, k), c["totals"].get(k, 0)) for k in STATES]
                same = all(p == h for p, h in cells)
                ok &= same
                sys.stdout.write(f"| {shape} | {c['rank']} | "
                                 + " | ".join(f"{p:,}" if p == h else f"{p:,} vs {h:,}" for p, h in cells)
                                 + f" | {same} |\n")
                sys.stdout.flush()
    sys.stdout.write("(bytes predicted; 'p vs h' where the prediction p differs from the count h)\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
