"""Topology that fits the machine: the shipped GPU topologies start one process per visible GPU (2 CPU processes
without a GPU, or ``--num-processes N``); never more ranks on a machine than asked or than it has devices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scale.config.load import configs_dir, yaml_load
from scale.config.validation import ConfigError
from scale.distributed.launch import LaunchError, check_ranks_per_machine
from scale.distributed.topology import GPU_TOPOLOGIES, processes_for, ranks_problem
from tests.conftest import ROOT, TINY_DATA


def _tree(name: str) -> dict:
    return yaml_load((configs_dir() / "accelerate" / f"{name}.yaml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", GPU_TOPOLOGIES)
@pytest.mark.parametrize("gpus, cores, requested, count", [
    (0, 2, None, 2),    # no GPU: 2 CPU processes, as configs/accelerate/cpu_*.yaml (the YAML says 8)
    (0, 16, None, 2),
    (2, 16, None, 2),   # one per visible GPU
    (8, 16, None, 8),
    (4, 16, 3, 3),      # --num-processes: fewer than the GPUs is fine
    (0, 4, 4, 4),       # on CPU up to the cores
])
def test_shipped_gpu_topologies_take_the_count_from_the_machine(name, gpus, cores, requested, count):
    assert _tree(name)["num_processes"] == 8  # for `accelerate launch --config_file` on an 8-GPU node
    got, why = processes_for(_tree(name), name, requested, gpus, cores)
    assert got == count and why


@pytest.mark.parametrize("name, gpus, cores, requested, message", [
    ("ddp", 2, 16, 3, "--accelerate-config ddp: 3 processes on this machine but 2 GPUs visible: at most one process "
                      "per GPU; use 2 (or set CUDA_VISIBLE_DEVICES); pass --num-processes N"),
    ("zero3", 0, 2, 8, "--accelerate-config zero3: 8 processes on this machine without a GPU and 2 CPU cores: at "
                       "most 2; pass --num-processes N"),
    ("single", 0, 2, 2, "--num-processes 2: single runs one process; use --accelerate-config ddp (or zero2, zero3) "
                        "for 2"),
    ("ddp", 1, 8, 0, "--accelerate-config ddp: 0 processes: at least 1; pass --num-processes N"),
])
def test_more_ranks_than_devices_is_refused_in_one_line(name, gpus, cores, requested, message):
    with pytest.raises(ConfigError) as e:
        processes_for(_tree(name), name, requested, gpus, cores)
    assert str(e.value) == message


def test_cpu_configs_and_own_yamls_keep_their_count():
    assert processes_for(_tree("cpu_zero2"), "cpu_zero2", None, 0, 2)[0] == 2
    assert processes_for(_tree("single"), "single", None, 4, 16) == (1, "one process")
    own = {"distributed_type": "MULTI_GPU", "num_processes": 3}  # a user's own YAML named like a shipped one
    assert processes_for(own, "ddp", None, 4, 16, shipped=False)[0] == 3
    with pytest.raises(ConfigError, match="3 processes on this machine but 2 GPUs visible"):
        processes_for(own, "ddp", None, 2, 16, shipped=False)
    # a multi-node YAML: num_processes is the total; each machine holds its share
    assert processes_for(_tree("multinode"), "multinode", None, 8, 16)[0] == 16
    with pytest.raises(ConfigError, match="8 processes on this machine but 4 GPUs visible"):
        processes_for(_tree("multinode"), "multinode", None, 4, 16)


@pytest.mark.parametrize("ranks, gpus, cores, fits", [(1, 0, 1, True), (2, 0, 1, True), (3, 0, 2, False),
                                                      (3, 0, 4, True), (8, 8, 2, True), (9, 8, 64, False)])
def test_ranks_per_machine_rule(ranks, gpus, cores, fits):
    assert (ranks_problem(ranks, gpus, cores) is None) == fits


def test_launch_guard_refuses_more_local_ranks_than_devices():
    """The same rule inside every rank, for launchers other than the wrapper (accelerate launch of ddp.yaml: 8)."""
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(LaunchError, match=rf"^{cores + 8} processes on this machine without a GPU and {cores} CPU "
                                          r"cores: at most \d+: launch with --num_processes N"):
        check_ranks_per_machine({"LOCAL_WORLD_SIZE": str(cores + 8)})
    check_ranks_per_machine({"LOCAL_WORLD_SIZE": "2"})  # the cpu_* configs
    check_ranks_per_machine({"LOCAL_SIZE": "1"})


def test_num_processes_without_a_launcher_config_is_refused(capsys):
    from scale.cli import main

    assert main(["--num-processes", "2", "--config", "tiny_cpu"]) == 2
    assert capsys.readouterr().err == ("scale-train: error: ConfigError: --num-processes needs --accelerate-config "
                                       "(the launcher starts the processes), e.g. scale-train --accelerate-config ddp "
                                       "--num-processes 2\n")


def test_wrapper_refuses_before_starting_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scale.cli", "--accelerate-config", "ddp", "--num-processes", "999",
                           "--config", "tiny_cpu", f"output_dir={tmp_path / 'out'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.splitlines()[-1].startswith("scale-train: error: ConfigError: --accelerate-config ddp: 999 "
                                                   "processes on this machine")


@pytest.mark.launch
def test_readme_ddp_one_liner_starts_one_rank_per_device(tmp_path):
    """`scale-train --accelerate-config ddp` (the README's line) on this GPU-less machine: 2 ranks, not the YAML's
    8, and the start-up log says the world size and the global batch."""
    from scale.training.metrics import read_jsonl

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "scale.cli", "--accelerate-config", "ddp", "--config", "tiny_cpu",
                           f"output_dir={out}", f"data.path={TINY_DATA}", "train.max_steps=2", "train.eval_every=0",
                           "eval.generate_samples=0", "log.trackers=[]", "log.peak_flops=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SCALE_PROGRESS": "lines"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("accelerate launch --config_file ddp.yaml --num_processes 2 (no GPU: 2 CPU processes, as the cpu_* "
            "configs)") in proc.stderr
    start = [line for line in proc.stderr.splitlines() if "start: mode=" in line]
    assert len(start) == 1 and "mode=ddp world_size=2 global_batch_size=32 (micro_batch_size=8 x " \
                               "gradient_accumulation_steps=2 x 2 data-parallel ranks)" in start[0], start
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] == [2]
