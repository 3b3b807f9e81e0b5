"""Same numbers under 2 CPU processes (gloo) through the real `accelerate launch` as one device (in process), and loud
launch guards.

Each launch costs ~20 s on 2 cores; the full matrix (two nodes, the deepspeed launcher) is in
``python benchmarks/parity.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.launching import (CHECKED, ROOT, TINY, assert_adapter_reproduces_eval, assert_invariants, modes, rel_dev,
                             run_mode, save_tiny_directory, weight_dev)
from scale.config.load import load_config
from scale.distributed.launch import LaunchError, check_launch_environment, cpu_threads_per_rank, reconcile_deepspeed
from scale.training.schedule import lr_factor

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(single_reference):
    """The single-device run every mode must reproduce (tests/conftest.py: launched once per session)."""
    return single_reference


def _expected_lrs(n_steps):
    cfg = load_config(TINY, ["optim.warmup_steps=2", f"train.max_steps={n_steps}", "optim.lr=0.5"])
    return [cfg.optim.lr * lr_factor(s, cfg.optim, n_steps) for s in range(n_steps)]


@pytest.mark.launch
def test_single_process_lr_follows_schedule(reference):
    assert reference["steps"] == [1, 2, 3, 4, 5, 6]
    assert rel_dev(_expected_lrs(6), reference["lr"]) < 1e-12
    assert_invariants(reference["checks"], "single 1x(8,1)", step=6)  # checkpointed LoRA on one device


# ZeRO-3 loads the model from a save_pretrained directory holding the built-in model's weights: from_pretrained under
# zero.Init on every rank, the path a real model takes (issue 21; the built-in tiny-llama is built in memory).
# Every row accumulates 2 micro-batches; one device accumulating 4 (single 1x(2,4)) is launched as the reference of
# tests/test_completions_launch.py and checked in process by tests/test_accumulation.py.
MODES = ["ddp 2x(2,2)"]
if __import__("importlib").util.find_spec("deepspeed") is not None:
    MODES += ["zero2 2x(2,2)", "zero3 from a directory 2x(2,2)"]


@pytest.fixture(scope="module")
def tiny_directory(tmp_path_factory):
    return save_tiny_directory(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.mark.launch
@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_single_device(mode, reference, tiny_directory, tmp_path):
    cmds, overrides = modes(tiny_directory)[mode]
    got = run_mode(cmds, overrides + CHECKED, tmp_path)
    assert_invariants(got["checks"], mode, step=6)  # checkpointed LoRA in this mode (tests/test_modes.py)
    # Every optimizer step, including the partial last window of each epoch (8, 8, 4 examples).
    assert rel_dev(reference["loss"], got["loss"]) < TOL
    assert rel_dev(reference["grad_norm"], got["grad_norm"]) < TOL
    assert weight_dev(reference["weights"], got["weights"]) < TOL
    assert rel_dev(_expected_lrs(6), got["lr"]) < 1e-12   # the scheduler steps once per optimizer step
    # Greedy generation at steps 0 and 6 (eval.generate_samples=4; ZeRO-3: every rank generates every sample on
    # the partitioned model, synced_gpus): the same text as one device, sample by sample.
    assert len(reference["samples"]) == 8 and got["samples"] == reference["samples"]
    if mode.startswith("zero3"):  # the adapter ZeRO-3 gathered to save is whole and reproduces the last evaluation
        assert_adapter_reproduces_eval(tmp_path)


@pytest.mark.launch
def test_fsdp2_shards_and_matches_single_device(reference, tmp_path):
    """accelerate's own FSDP2 preparation (``fully_shard`` per decoder layer) on 2 CPU processes through the test-only
    shim (tests/fsdp_cpu.py, which only relabels the device type): the weights are really sharded, the numbers are
    one device's, and the gathered adapter is whole."""
    from scale.training.metrics import read_jsonl

    cmds, overrides = modes()["fsdp2 2x(2,2)"]
    got = run_mode(cmds, overrides + ["train.check_invariants=true"], tmp_path)
    assert rel_dev(reference["loss"], got["loss"]) < TOL
    assert got["samples"] == reference["samples"]  # lock-step generation (synced_gpus) gives the same text
    assert rel_dev(reference["grad_norm"], got["grad_norm"]) < TOL
    assert weight_dev(reference["weights"], got["weights"]) < TOL   # same 28 LoRA tensors, full shapes
    checks = next(r for r in read_jsonl(tmp_path / "metrics.jsonl") if "check/base_unchanged" in r)
    assert 0.45 < checks["check/param_elements_local_fraction"] < 0.55   # each rank holds half of every weight
    assert checks["check/base_unchanged"] and checks["check/lora_B_nonzero"] and checks["check/lora_B_tensors"] == 14


# ---- guards: each fails loudly at start-up ----

def test_guard_multi_cpu_launch_that_starts_one_process():
    env = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1"}
    with pytest.raises(LaunchError, match=r"started ONE process .* configs/accelerate/cpu_ddp.yaml"):
        check_launch_environment(env)
    check_launch_environment({**env, "WORLD_SIZE": "2"})      # a real 2-process launch passes
    check_launch_environment({"ACCELERATE_MIXED_PRECISION": "no"})   # a single-process accelerate launch passes


@pytest.mark.launch
def test_guard_real_launch_cpu_num_processes_2_exits_with_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "-m", "scale.train",
         "--config", str(TINY), f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode != 0
    assert "accelerate launch started ONE process for a multi-process CPU launch" in proc.stderr + proc.stdout


def test_guard_world_size_without_process_group(monkeypatch, tmp_path):
    import scale.distributed.launch as launch
    from accelerate.utils import DistributedType

    class FakeAccelerator:
        distributed_type = DistributedType.NO

        def __init__(self, **kwargs):
            pass

    monkeypatch.setattr(launch, "Accelerator", FakeAccelerator)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(LaunchError, match=r"WORLD_SIZE=2 but accelerate runs DistributedType.NO: .*unsynced replicas"):
        launch.build_accelerator(load_config(TINY, [f"output_dir={tmp_path}"]))


def test_guard_deepspeed_dropped(monkeypatch, tmp_path):
    import scale.distributed.launch as launch
    from accelerate.utils import DistributedType

    class FakeAccelerator:
        distributed_type = DistributedType.MULTI_CPU   # what cpu=True + a DeepSpeed config silently gives

        def __init__(self, **kwargs):
            assert kwargs["cpu"] is False   # we never pass cpu=True with DeepSpeed
            assert any(type(h).__name__ == "InitProcessGroupKwargs" for h in kwargs["kwargs_handlers"])

    monkeypatch.setattr(launch, "Accelerator", FakeAccelerator)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaunchError, match=r"a DeepSpeed launch ended up as .*MULTI_CPU.*DeepSpeed was dropped"):
        launch.build_accelerator(load_config(TINY, [f"output_dir={tmp_path}"]))


def test_guard_fsdp_dropped(monkeypatch, tmp_path):
    import scale.distributed.launch as launch
    from accelerate.utils import DistributedType

    class FakeAccelerator:
        distributed_type = DistributedType.MULTI_CPU   # what an FSDP config gives on CPU (accelerate 1.15)

        def __init__(self, **kwargs):
            pass

    monkeypatch.setattr(launch, "Accelerator", FakeAccelerator)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(LaunchError, match=r"an FSDP launch ended up as .*MULTI_CPU.*enters FSDP only on GPUs"):
        launch.build_accelerator(load_config(TINY, [f"output_dir={tmp_path}"]))


def test_guard_deepspeed_json_contradicting_training_config():
    cfg = load_config(TINY, ["train.gradient_accumulation_steps=2", "optim.max_grad_norm=0.5"])
    ds = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto"}
    reconcile_deepspeed(cfg, ds)
    assert ds == {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 8}
    with pytest.raises(LaunchError, match=r"sets gradient_accumulation_steps=4 but the training config has 2"):
        reconcile_deepspeed(cfg, {"gradient_accumulation_steps": 4})
    with pytest.raises(LaunchError, match=r"sets gradient_clipping=1.0 but the training config has 0.5"):
        reconcile_deepspeed(cfg, {"gradient_clipping": 1.0})


def test_guard_deepspeed_launcher_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        cpu_threads_per_rank({"LOCAL_SIZE": "2"})        # the deepspeed launcher's variables, no OMP_NUM_THREADS
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        cpu_threads_per_rank({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "2"})   # an explicit choice is left alone
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
