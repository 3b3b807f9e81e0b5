"""Start-up cost: ``import scale.train`` and the tiny job's wall time, and which heavy packages a run imports.

    python benchmarks/startup.py                               # this checkout, 3 repeats (~1 min on 2 idle cores)
    python benchmarks/startup.py --against /path/to/old/checkout --repeats 5   # alternate with another checkout

Each measurement is a fresh ``python`` process with ``PYTHONPATH`` set to the checkout under test:

- ``import scale.train``: wall time of ``python -c 'import scale.train'`` (interpreter start included);
- tiny job: wall time of ``python -m scale.train --config configs/train/tiny_cpu.yaml`` (12 steps of a random
  tiny Llama; start-up dominates it), output in a temporary directory, trackers off;
- heavy imports: which of deepspeed, wandb, bitsandbytes, matplotlib, datasets, torch._inductor are in
  ``sys.modules`` when the tiny job has finished (run in-process through ``scale.cli.main``).

Checkouts alternate (this, other, this, ...) so that a busy machine slows both alike; medians and min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("deepspeed", "wandb", "bitsandbytes", "matplotlib", "datasets", "torch._inductor")
PROBE = f"""
import inspect, sys, json
from scale.cli import main
own = {{"own_process": True}} if "own_process" in inspect.signature(main).parameters else {{}}  # as scale-train runs
rc = main(["--config", "configs/train/tiny_cpu.yaml", "output_dir=" + sys.argv[1], "log.trackers=[]"], **own)
print(json.dumps({{m: sys.modules.get(m) is not None for m in {HEAVY!r}}}))  # None: kept out (scale.cli.start_fast)
"""


def timed(cmd: list[str], tree: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} in {tree} failed:\n{proc.stderr[-3000:]}")
    return wall


def heavy_imports(tree: Path) -> dict[str, bool]:
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", PROBE, tmp], cwd=tree, env=env, capture_output=True, text=True,
                              check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"probe in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default=None, help="another checkout of scale to alternate with (e.g. before a change)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    trees = {"this": ROOT}
    if a.against:
        trees["other"] = Path(a.against).resolve()
    imp: dict[str, list[float]] = {k: [] for k in trees}
    job: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(a.repeats):
        for name, tree in trees.items():
            imp[name].append(timed([sys.executable, "-c", "import scale.train"], tree))
            with tempfile.TemporaryDirectory() as tmp:
                job[name].append(timed([sys.executable, "-m", "scale.train", "--config", "configs/train/tiny_cpu.yaml",
                                        f"output_dir={tmp}", "log.trackers=[]"], tree))
    from benchmarks.common import fmt_spread, machine_line

    lines = ["| checkout | `import scale.train` (s) | tiny job wall (s) | heavy packages imported by the tiny job |",
             "|---|---|---|---|"]
    for name, tree in trees.items():
        mods = heavy_imports(tree)
        loaded = ", ".join(m for m, on in mods.items() if on) or "none"
        lines.append(f"| {name} ({tree}) | {fmt_spread(imp[name])} | {fmt_spread(job[name])} | {loaded} |")
    sys.stdout.write("\n".join([f"{a.repeats} repeats, alternating; median (min-max)", *lines, machine_line()]) + "\n")
    if "other" in trees:
        ratio = statistics.median(job["other"]) / statistics.median(job["this"])
        sys.stdout.write(f"tiny job wall, other/this: {ratio:.2f}\n")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
