"""The compatibility seam (scale/utils/compat.py): checkpointing on both transformers APIs, the tested ranges against
pyproject.toml's bounds, the out-of-range warning of scale-train's start-up, and scale-env's report."""

from __future__ import annotations

import logging
import os
import re
import sys

import pytest

from scale.utils import compat
from scale.utils.compat import TESTED, enable_checkpointing, in_tested_range, untested_dependencies
from tests.conftest import ROOT


def test_the_tested_lower_ends_are_pyprojects_bounds_and_torch_is_cis_wheel():
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        from lowest import dependencies, lowest_pins
    finally:
        sys.path.pop(0)
    deps = dependencies(ROOT / "pyproject.toml")
    declared = dict(re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9.]+)", d.replace(" ", "")).groups() for d in deps)
    assert set(declared) == set(TESTED)
    lows = {n: lo for n, (lo, _) in TESTED.items() if n != "torch"}
    assert lows == {n: b for n, b in declared.items() if n != "torch"}
    # torch: only the CPU wheel the Makefile installs is tested (PyPI's Linux wheels are CUDA builds)
    makefile_torch = re.search(r"^TORCH \?= torch==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert TESTED["torch"] == (makefile_torch, makefile_torch)
    assert lowest_pins(ROOT / "pyproject.toml") == [f"{n}=={b}" for n, b in declared.items() if n != "torch"]


@pytest.mark.parametrize("version, inside", [
    ("5.17", True), ("5.17.0", True), ("5.16.9", False), ("5.25.0", True), ("5.25.3", True), ("5.26.0", False),
    ("6.0.0", False), ("5.20.0.dev0", True), ("4.57.6", False)])
def test_tested_range_is_the_lowest_bound_up_to_the_newest_tested_minor(version, inside):
    assert in_tested_range(version, "5.17", "5.25.0") is inside


def test_torch_local_version_label_and_trailing_zeros_do_not_count():
    assert compat.release("2.13.0+cpu") == (2, 13, 0) and in_tested_range("2.13.0+cpu", "2.13.0", "2.13.0")
    assert in_tested_range("1.10.0", "1.10", "1.16.0") and not in_tested_range("1.9.9", "1.10", "1.16.0")


def test_the_out_of_range_line_names_each_untested_dependency(monkeypatch):
    fake = {"transformers": "5.16.0", "accelerate": "1.17.1", "peft": None}  # None: not installed, not reported
    real = compat.installed
    monkeypatch.setattr(compat, "installed", lambda name: fake[name] if name in fake else real(name))
    (acc_lo, acc_hi), (tf_lo, tf_hi) = TESTED["accelerate"], TESTED["transformers"]
    assert untested_dependencies({n: TESTED[n] for n in ("accelerate", "transformers", "peft")}) == (
        f"untested dependency versions: accelerate 1.17.1 (tested {acc_lo}..{acc_hi}), transformers 5.16.0 (tested "
        f"{tf_lo}..{tf_hi}); scale-env prints the whole environment for a bug report")
    monkeypatch.setattr(compat, "installed", lambda name: TESTED[name][0])  # every lowest bound: inside
    assert untested_dependencies() is None


def test_scale_train_start_up_warns_once_when_a_dependency_is_outside(tmp_path, monkeypatch, caplog):
    from scale.training.job import setup
    from tests.conftest import tiny_cfg

    real = compat.installed
    monkeypatch.setattr(compat, "installed", lambda name: "5.16.0" if name == "transformers" else
                        TESTED[name][0] if name in TESTED else real(name))
    cfg = tiny_cfg(tmp_path / "out", "train.max_steps=1", "log.trackers=[]", "log.peak_flops=false",
                   "eval.generate_samples=0")
    with caplog.at_level(logging.INFO):
        setup(cfg)
    warned = [r for r in caplog.records if "untested dependency versions" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in warned] == [(logging.WARNING, (
        f"[RANK 0] untested dependency versions: transformers 5.16.0 (tested 5.17..{TESTED['transformers'][1]}); "
        "scale-env prints the whole environment for a bug report"))]


class _OldModel:
    """transformers 5.17-5.22: ``gradient_checkpointing_enable`` only (no ``activation_checkpointing_enable``)."""

    def __init__(self):
        self.calls = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.calls.append(("gradient", gradient_checkpointing_kwargs, every_n_layers, offload))


class _NewModel(_OldModel):
    """transformers >= 5.23: both; the old name is a deprecated alias."""

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.calls.append(("activation", activation_checkpointing_kwargs, every_n_layers, offload))


@pytest.mark.parametrize("cls, api", [(_OldModel, "gradient"), (_NewModel, "activation")])
def test_checkpointing_goes_through_the_api_the_model_has(cls, api):
    model = cls()
    assert not hasattr(_OldModel(), "activation_checkpointing_enable")
    enable_checkpointing(model, {"use_reentrant": False}, every_n_layers=3, offload=True)
    assert model.calls == [(api, {"use_reentrant": False}, 3, True)]


def test_checkpointing_on_the_installed_transformers_checkpoints_every_nth_layer_without_a_warning():
    """The real model, on whichever API this environment's transformers has (the lowest-versions tier runs 5.17's
    ``gradient_checkpointing_enable``, the newest tier ``activation_checkpointing_enable``): every second decoder
    layer checkpoints, and the newest API raises no FutureWarning (the deprecated name is not called)."""
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_checkpointing(model, {"use_reentrant": False}, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]
    assert model.is_gradient_checkpointing


def test_scale_env_reports_the_real_versions_devices_and_launcher_variables(monkeypatch):
    import platform

    import torch

    from scale.env import cpu_info, report

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("WANDB_API_KEY", "not-for-a-bug-report")
    text = report()
    lines = text.splitlines()
    assert lines[0] == "## scale-env"
    assert f"- torch: {torch.__version__} (inside the tested range {TESTED['torch'][0]}..{TESTED['torch'][1]})" in lines
    for name, (lo, hi) in TESTED.items():
        version = compat.installed(name)
        where = "inside" if in_tested_range(version, lo, hi) else "OUTSIDE"
        assert f"- {name}: {version} ({where} the tested range {lo}..{hi})" in lines
    assert f"- Python: {platform.python_version()} ({platform.python_implementation()})" in lines
    assert f"- torch CUDA build: {torch.version.cuda or 'none (CPU build)'}; available: {torch.cuda.is_available()}; " \
           in text
    model, flags = cpu_info()
    cpu = next(line for line in lines if line.startswith("- CPU: "))
    assert cpu.startswith(f"- CPU: {model}; {os.cpu_count()} logical cores; flags: ")
    assert f"avx512_bf16={'yes' if flags['avx512_bf16'] else 'no'}" in cpu and "amx_bf16=" in cpu and "avx2=" in cpu
    assert f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}" in text
    launcher = lines[lines.index("### launcher variables") + 1:]
    assert {"- WORLD_SIZE=16", "- SLURM_JOB_ID=4242", "- ACCELERATE_MIXED_PRECISION=bf16"} <= set(launcher)
    assert "not-for-a-bug-report" not in text


def test_cpu_flags_are_read_from_cpuinfo():
    from scale.env import cpu_info

    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9454 48-Core Processor\nflags\t\t: fpu sse avx2 fma avx512f "
            "avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: amx_tile\n")
    model, flags = cpu_info(text)
    assert model == "AMD EPYC 9454 48-Core Processor"
    assert [f for f, on in flags.items() if on] == ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]


def test_a_moe_model_on_a_peft_without_target_parameters_is_one_line(monkeypatch):
    """LoRA on fused experts needs peft's target_parameters (peft 0.17): an older peft is refused in one line that
    names the fix (on the lowest tier's peft 0.15 the check is real; elsewhere it is made to answer False)."""
    from scale.config.validation import ConfigError
    from scale.modeling import moe
    from tests.test_moe import tiny_moe

    if moe.peft_adapts_parameters():
        monkeypatch.setattr(moe, "peft_adapts_parameters", lambda: False)
    layout = moe.moe_layout(tiny_moe("qwen3_moe"))
    assert layout is not None and layout.family == "qwen3_moe"
    with pytest.raises(ConfigError, match=r"^model\.name_or_path is a mixture-of-experts model \(qwen3_moe\) .*needs "
                                          r"peft's target_parameters, which peft \S+ lacks; pip install -U peft$"):
        moe.lora_targets(layout, "all-linear", False, [])
