"""The package runs from any directory (issue 11): after a non-editable `pip install .` into a fresh virtualenv,
a 2-process ZeRO-2 launch of the shipped tiny job runs from a directory outside the checkout; then, from an
editable install, the named config and its data resolve to the checkout from there. The dependencies (torch, transformers, DeepSpeed...) come from the test's own
environment through a `.pth` file: installing them again would test pip and cost ~2 min; the package itself is
built and installed for real (`pip install --no-deps`). `launch` marker (~1 min).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.launch


def _sh(cmd, cwd, env, timeout=1200):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def sysconfig_paths():
    """This interpreter's site-packages directories (purelib and platlib)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def _final_eval(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r][-1]


def test_installed_package_runs_the_tiny_job_and_zero2_from_anywhere(tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "elsewhere"
    work.mkdir()
    _sh([sys.executable, "-m", "venv", str(venv)], tmp_path, os.environ)
    pip, bin_dir = venv / "bin" / "pip", venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    # The dependencies: this environment's site-packages, appended to the fresh venv's path. A path line in a
    # .pth file is not itself processed for .pth files, so this checkout's editable install does not come along.
    deps = [p for p in sysconfig_paths() if "site-packages" in p]
    site = Path(_sh([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    tmp_path, env).stdout.strip())
    (site / "zz_test_deps.pth").write_text("\n".join(deps) + "\n")
    build = tmp_path / "src"  # a copy: the build must not leave build/ or *.egg-info in the checkout
    shutil.copytree(ROOT, build, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__"))
    _sh([str(pip), "install", "-q", "--no-deps", str(build)], tmp_path, env)
    where = _sh([str(bin_dir / "python"), "-c", "import scale, torch; print(scale.__file__)"], work, env).stdout
    assert where.startswith(str(site)), where  # the installed copy, not this checkout

    # The shipped tiny job through the shipped 2-process ZeRO-2 topology (the wrapper, then one process per rank).
    _sh([str(bin_dir / "scale-train"), "--accelerate-config", "cpu_zero2", "--config", "tiny_cpu",
         "train.max_steps=2", "output_dir=zero2"], work, env)
    assert _final_eval(work / "zero2")["eval/examples"] == 32
    saved = (work / "zero2" / "config.yaml").read_text()
    assert f"{venv}/lib/" in saved and "scale/configs/data/tiny_reviews.jsonl" in saved  # the shipped data
    # The SFT job's chat template ships too: its config names it relative to itself.
    probe = "from scale.config.load import load_config; print(open(load_config('sft').data.chat_template).read())"
    assert "<|im_start|>" in _sh([str(bin_dir / "python"), "-c", probe], work, env).stdout

    _sh([str(pip), "install", "-q", "--no-deps", "-e", str(build)], tmp_path, env)  # editable: the checkout's
    # (training from an editable install is what every other test does; here: from another directory, the named
    # config and its data resolve to the checkout, and the command's data path reads them)
    probe = "from scale.config.load import load_config; print(load_config('tiny_cpu').data.path)"
    assert _sh([str(bin_dir / "python"), "-c", probe], work, env).stdout.strip() == \
        f"{build}/configs/data/tiny_reviews.jsonl"
    rows = _sh([str(bin_dir / "scale-train"), "--config", "tiny_cpu", "--show-rows", "1"], work, env).stdout
    assert "Review: " in rows and "Sentiment:[[" in rows
