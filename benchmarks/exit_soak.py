"""Clean exit: run the tiny job N times under 2 CPU processes and count exit codes.

    python benchmarks/exit_soak.py [--runs 20] [--config cpu_ddp.yaml]

torch 2.13 + gloo aborted 10-25% of such runs at interpreter exit before `scale-train` ended the process
group and left through ``os._exit`` (pytorch/pytorch#190489).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/exit_soak.py`: make `tests.launching` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.launching import ROOT, TINY, accelerate_cmd  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--config", default="cpu_ddp.yaml")
    args = parser.parse_args()
    codes, aborts = [], 0
    t0 = time.perf_counter()
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(accelerate_cmd(args.config) + ["--config", str(TINY), f"output_dir={out}",
                                  "train.max_steps=2", "train.eval_every=0", "log.trackers=[]"],
                                  cwd=ROOT, capture_output=True, text=True)
        codes.append(proc.returncode)
        aborts += "terminate called without an active exception" in proc.stderr
        sys.stdout.write(f"run {i + 1:2d}: exit {proc.returncode}\n")
        sys.stdout.flush()
    ok = sum(c == 0 for c in codes)
    sys.stdout.write(f"\n{ok}/{args.runs} runs exited 0; {aborts} printed the gloo exit abort; "
                     f"{time.perf_counter() - t0:.0f} s\n")
    return 0 if ok == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
