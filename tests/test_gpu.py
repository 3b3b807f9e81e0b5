"""GPU-only checks (deselected by default; run with ``python -m pytest -m gpu``).

- bf16 QLoRA on the real SmolLM2-135M: trains, stays bf16 where it should, and is faster per step than
  the fp32 LoRA baseline on the same job;
- FSDP2 + QLoRA through ``accelerate launch`` (2 GPUs): same per-step loss as single-GPU within bf16 noise;
- ``loss.fused: liger`` (Liger-Kernel's fused linear cross-entropy, Triton): the chunked loss's numbers (not yet
  run: no GPU machine has run this file since it was added).
"""

from __future__ import annotations

import time

import pytest
import torch

from scale.metrics import read_jsonl

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_bf16_qlora_trains_and_beats_fp32_lora_per_step(tmp_path):
    from scale.config import load_config
    from scale.train import run

    common = ["train.max_steps=30", "train.eval_every=0", "data.eval_size=64", "log.trackers=[]",
              "train.micro_batch_size=16", "train.log_every=10"]
    timings = {}
    for name, extra in {
        "qlora_bf16": ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=bfloat16",
                       "model.dtype=bfloat16", "train.mixed_precision=bf16"],
        "lora_fp32": ["model.quantize_4bit=false", "model.dtype=float32"],
    }.items():
        out = tmp_path / name
        t0 = time.perf_counter()
        run(load_config(None, [f"output_dir={out}", *common, *extra]))
        timings[name] = time.perf_counter() - t0
        rows = read_jsonl(out / "metrics.jsonl")
        losses = [r["train/loss"] for r in rows if "train/loss" in r]
        assert losses[-1] < losses[0]
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert timings["qlora_bf16"] < 1.5 * timings["lora_fp32"], timings


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp2_qlora_matches_single_gpu(tmp_path):
    import sys

    from tests.launching import accelerate_cmd, run_mode

    qlora = ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=bfloat16", "model.dtype=bfloat16",
             "model.bnb_4bit_quant_storage=bfloat16", "train.mixed_precision=bf16"]
    single = run_mode([[sys.executable, "-m", "scale.train"]],
                      ["train.micro_batch_size=4", "train.gradient_accumulation_steps=1", *qlora], tmp_path / "one")
    fsdp = run_mode([accelerate_cmd("fsdp2.yaml", ["--num_processes", "2"])],
                    ["train.micro_batch_size=2", "train.gradient_accumulation_steps=1", *qlora], tmp_path / "fsdp")
    assert len(single["loss"]) == len(fsdp["loss"])
    for a, b in zip(single["loss"], fsdp["loss"]):
        assert abs(a - b) <= 2e-2 * abs(a)   # bf16


@needs_cuda
def test_liger_fused_loss_matches_the_chunked_loss():
    """Liger's fused linear cross-entropy against scale.chunked's fused path on the same tail hidden states: loss
    and hidden-state gradient within fp32 round-off (both compute the logits chunk by chunk in fp32)."""
    pytest.importorskip("liger_kernel")
    from scale import chunked

    g = torch.Generator(device="cuda").manual_seed(0)
    M, H, V = 700, 576, 49152  # a long SFT tail of SmolLM2's shape: chunked by loss.chunk_size=auto
    head = torch.nn.Linear(H, V, bias=False, device="cuda").requires_grad_(False)
    model = torch.nn.Module()
    model.get_output_embeddings = lambda: head
    hidden = torch.randn(1, M, H, device="cuda", generator=g)
    targets = torch.randint(0, V, (1, M), device="cuda", generator=g)
    weights = (torch.rand(1, M, device="cuda", generator=g) > 0.2).float()  # some positions outside the tail
    chunk = chunked.resolve_chunk_size("auto", M, V)
    assert chunk and chunked.resolve_chunk_size("liger", M, V) == chunk
    out = {}
    for fused in (None, "liger"):
        h = hidden.clone().requires_grad_(True)
        num, den = chunked.chunked_tail_loss(model, h, targets, weights, chunk, fused=fused)
        num.backward()
        out[fused] = (num.item(), den.item(), h.grad)
    assert out["liger"][1] == out[None][1] == weights.sum().item()
    assert out["liger"][0] == pytest.approx(out[None][0], rel=1e-5)
    torch.testing.assert_close(out["liger"][2], out[None][2], rtol=1e-4, atol=1e-6)
