"""Fast start: a run imports DeepSpeed, W&B, matplotlib and (in a process of its own) bitsandbytes only when it
uses them, and no DeepSpeed op is compiled behind the user's back (the shared-memory op is skipped; an offload run
that will compile says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_DATA


@pytest.mark.slow
def test_tiny_job_imports_no_deepspeed_wandb_or_matplotlib(tmp_path):
    probe = ("import json, sys\nfrom scale.cli import main\n"
             f"rc = main(['--config', 'configs/train/tiny_cpu.yaml', 'output_dir={tmp_path}', 'data.path={TINY_DATA}', "
             "'train.max_steps=2', 'log.trackers=[]'], own_process=True)\n"
             "print(json.dumps([rc] + [m in sys.modules for m in ('deepspeed', 'wandb', 'matplotlib')]\n"
             "                 + [sys.modules.get('bitsandbytes', 'absent')]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, False, False, False, None]  # bitsandbytes kept out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()  # it saved (unwrap without DeepSpeed)


def test_bitsandbytes_is_needed_for_4bit_a_quantized_directory_or_a_hub_id(tmp_path):
    from scale.config.schema import ModelConfig
    from scale.modeling.build import needs_bitsandbytes

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "nf4").mkdir()
    (tmp_path / "nf4" / "config.json").write_text('{"model_type": "llama", "quantization_config": {"load_in_4bit": true}}')
    needs = {name: needs_bitsandbytes(ModelConfig(name_or_path=name)) for name in
             ("tiny-llama", "smollm2-135m", str(tmp_path / "plain"), str(tmp_path / "nf4"), "org/some-model")}
    assert list(needs.values()) == [False, False, False, True, True]
    assert needs_bitsandbytes(ModelConfig(name_or_path="tiny-llama", quantize_4bit=True))


def test_compile_at_import_is_deferred_to_the_first_call(tmp_path, monkeypatch):
    """scale.cli.import_with_lazy_compile (DeepSpeed's Muon module): nothing compiles at import; the first call
    compiles once, with the decorator's arguments, and returns the compiled function's result."""
    import torch

    from scale.cli import import_with_lazy_compile

    calls = []

    def spy(fn, **kwargs):
        calls.append((fn.__name__, kwargs))
        return lambda *a: fn(*a) + 100

    (tmp_path / "compiled_at_import.py").write_text(
        "import torch\n\n@torch.compile\ndef double(x):\n    return 2 * x\n\n"
        "@torch.compile(mode='max-autotune')\ndef triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch, "compile", spy)
    import_with_lazy_compile("compiled_at_import")
    assert torch.compile is spy and calls == []  # restored; nothing compiled yet
    mod = sys.modules["compiled_at_import"]
    assert (mod.double(1), mod.double(2), mod.triple(1)) == (102, 104, 103)
    assert calls == [("double", {}), ("triple", {"mode": "max-autotune"})]  # once each, on first use
    import_with_lazy_compile("no_such_module_here")  # an older DeepSpeed without the module: nothing happens


def test_deepspeed_shm_op_is_not_built():
    import importlib

    from scale.distributed.launch import skip_deepspeed_shm_op

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `import deepspeed.comm.torch as` finds torch

    skip_deepspeed_shm_op()
    assert ds_torch.build_shm_op() is None  # no compile: training collectives go through gloo


def test_offload_notice_only_when_an_op_will_compile(tmp_path, monkeypatch):
    from scale.distributed.launch import deepspeed_op_notice

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert deepspeed_op_notice({"zero_optimization": {"stage": 2}}) is None
    assert deepspeed_op_notice({**offload, "zero_force_ds_cpu_optimizer": False}) is None
    notice = deepspeed_op_notice(offload)
    assert notice.startswith("optimizer offload (cpu): DeepSpeed swaps AdamW for DeepSpeedCPUAdam and compiles its "
                             "cpu_adam op on this first launch") and str(tmp_path / "cpu_adam") in notice
    (tmp_path / "cpu_adam").mkdir(exist_ok=True)
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert deepspeed_op_notice(offload) is None  # built once: no notice


def test_bf16_qlora_on_cpu_keeps_lora_and_adam_fp32_and_tracks_fp32(tmp_path):
    """bf16 compute (4-bit dequantized to bf16, autocast) on CPU: the matmuls run in bf16, the LoRA weights and
    AdamW state stay fp32, and the losses follow the fp32 run within bf16 precision."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from scale.train import fit
    from scale.training.checks import dtype_census
    from scale.training.job import setup
    from scale.training.metrics import read_jsonl
    from tests.conftest import tiny_cfg

    job = ["model.quantize_4bit=true", "train.max_steps=4", "train.log_every=1", "train.eval_every=0",
           "train.save_adapter=false", "model.gradient_checkpointing=false"]
    losses = {}
    for name, extra in {"fp32": [], "bf16": ["model.bnb_4bit_compute_dtype=bfloat16",
                                             "train.mixed_precision=bf16"]}.items():
        j = setup(tiny_cfg(tmp_path / name, *job, *extra))
        seen = []
        lora_a = next(m for n, m in j.model.named_modules() if n.endswith("q_proj.lora_A.default"))
        handle = lora_a.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        fit(j)
        handle.remove()
        census = dtype_census(j.model)
        assert census["float32/trainable"] > 0 and not any(k.endswith("/trainable") and not k.startswith("float32")
                                                           for k in census), census
        states = [s for s in j.optimizer.state_dict()["state"].values()]
        assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
        assert set(seen) == {torch.bfloat16 if name == "bf16" else torch.float32}
        losses[name] = [r["train/loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "train/loss" in r]
        j.acc.end_training()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert len(losses["bf16"]) == 4
    assert all(abs(a - b) <= 2e-2 * a for a, b in zip(losses["fp32"], losses["bf16"])), losses
