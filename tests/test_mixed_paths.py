"""The mixed-precision paths a CUDA run takes (scale.modeling.mixed_paths.DEVICE_PATHS), run under bf16 autocast on the
CPU (the same code: every path reads the autocast state of the tensors' own device) and, with ``-m gpu``, on a GPU:
fewer casts per forward and backward, gradients within bf16 round-off of the float32 model's."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scale.config.schema import LoraConfig, ModelConfig
from scale.modeling import mixed_paths, build as modeling
from tests.bounds import EPS_BF16, rel_bound

V = 300
LORA_LAYERS = 14  # tiny-llama: 2 decoder layers x 7 linear layers (q, k, v, o, gate, up, down)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]

# Rounding to bf16 on the way from the loss to a LoRA gradient, per decoder layer, forward then backward: the normed
# input, q/k/v, the attention output, o_proj's output, the second norm, gate, up, silu(gate) * up, down's output
# (9 forward) and the same 9 products in the backward; 2 layers plus the head's input and output: 38 roundings.
ROUNDINGS = 2 * 2 * 9 + 2
GRAD_REL = rel_bound(ROUNDINGS, EPS_BF16 / 2)
"""How far bf16-autocast LoRA gradients may be from the float32 model's, relative (the root of the summed squares
over every LoRA tensor): each of the :data:`ROUNDINGS` roundings on a gradient's path is a relative error of at most
the unit round-off ``u = eps_bf16 / 2 = 2**-8``, of random sign, so together ``C u sqrt(38)`` (tests/bounds.py's
``rel_bound``: 0.096); the GEMMs accumulate in float32 (oneDNN and cuBLAS do), ``C eps32 sqrt(H)``, negligible.
A wrong path (an adapter output dropped or scaled twice, a gradient cut) moves the gradients by tens of percent."""


class CastCount(TorchDispatchMode):
    """Counts aten ops by name (``_to_copy`` is every dtype cast: ``Tensor.to``, autocast's casts, peft's)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def tiny(quantize: bool, device: str, seed: int = 0) -> torch.nn.Module:
    """The tiny Llama + LoRA r=4 on ``device`` (NF4 base with bf16 compute when ``quantize``), every ``lora_B``
    drawn non-zero so that every LoRA tensor gets a gradient."""
    cfg = ModelConfig(name_or_path="tiny-llama", quantize_4bit=quantize, gradient_checkpointing=False,
                      bnb_4bit_compute_dtype="bfloat16" if quantize else "float32")
    device_map = {"": torch.device(device).index or 0} if quantize and device == "cuda" else None
    model = modeling.build_model(cfg, LoraConfig(r=4, alpha=8.0, dropout=0.0), vocab_size=V, seed=seed,
                                 device_map=device_map)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.to(device) if not quantize else model


def fp32_twin(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """The float32 model holding ``model``'s (dequantized) base weights and its LoRA weights."""
    ref = tiny(False, "cpu")
    state = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if getattr(w, "quant_state", None) is not None:
            import bitsandbytes as bnb

            state[f"{name}.weight"] = bnb.functional.dequantize_4bit(w.data, w.quant_state).float().cpu()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            src = state.get(name)
            if src is None:
                src = dict(model.named_parameters())[name].detach().float().cpu()
            p.copy_(src)
    return ref.to(device)


def step(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> dict[str, torch.Tensor]:
    """LoRA gradients (float32 copies) of one forward and backward of ``sum(tail logits ** 2) / n``."""
    model.zero_grad(set_to_none=True)
    dev = ids.device.type
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=3).logits
    logits.float().pow(2).mean().backward()
    return {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def rel(a: dict, b: dict) -> float:
    return float(sum((a[n] - b[n]).pow(2).sum() for n in b) ** 0.5 / sum(b[n].pow(2).sum() for n in b) ** 0.5)


def test_cuda_takes_every_path_but_the_cpu_attention():
    assert mixed_paths.paths_for("cpu") == tuple(mixed_paths.MIXED_PATHS)
    assert set(mixed_paths.paths_for("cuda")) == set(mixed_paths.MIXED_PATHS) - {"attention_fp32_short"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantize", [True, False], ids=["qlora", "lora-fp32-base"])
def test_device_paths_cast_less_and_keep_the_gradients_within_bf16_round_off(quantize, device):
    """The CUDA set of paths on a bf16-autocast step: fewer ``_to_copy`` (dtype casts) per forward and backward, at
    least one per LoRA layer (the input cast once for base and adapter, shared by q/k/v and gate/up; the 4-bit
    base's output no longer cast back to float32); gradients within :data:`GRAD_REL` of the float32 model's, as
    the step without the paths is; switched off, the step is the old one bit for bit."""
    if quantize:
        pytest.importorskip("bitsandbytes")
    ids = torch.randint(3, V, (4, 24), generator=torch.Generator().manual_seed(7)).to(device)
    model = tiny(quantize, device)
    ref = step(fp32_twin(model, device), ids, autocast=False)
    step(model, ids, autocast=True)  # warm-up: lazy initialisations are not casts of a step
    with CastCount() as before:
        old = step(model, ids, autocast=True)
    switched = mixed_paths.use_mixed_paths(model, mixed_paths.paths_for("cuda"))
    assert "adapter_inputs_cast_once" in switched and "adapter_sum_in_addmm" in switched
    step(model, ids, autocast=True)
    with CastCount() as after:
        new = step(model, ids, autocast=True)
    casts_before, casts_after = before.ops["_to_copy"], after.ops["_to_copy"]
    assert casts_after <= casts_before - LORA_LAYERS, (casts_before, casts_after)
    assert rel(old, ref) <= GRAD_REL and rel(new, ref) <= GRAD_REL, (rel(old, ref), rel(new, ref), GRAD_REL)
    mixed_paths.use_mixed_paths(model, mixed_paths.paths_for("cuda"), on=False)
    again = step(model, ids, autocast=True)
    if device == "cpu":  # CUDA's atomics-based kernels may sum in another order from run to run
        assert all(torch.equal(again[n], old[n]) for n in old)


# Two more bf16 roundings per layer with the residual stream in bf16: the two residual adds, forward and backward.
RESIDUAL_REL = rel_bound(ROUNDINGS + 2 * 2 * 2, EPS_BF16 / 2)
""":data:`GRAD_REL` with the 8 residual-add roundings of a bf16 residual stream (2 layers): ``C u sqrt(46)`` = 0.106."""


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_residual_in_the_compute_dtype_tracks_fp32_as_the_fp32_upcast_does(device):
    """``model.qlora_residual_dtype: compute`` leaves the embeddings, norms and head of a bf16-loaded 4-bit model in
    bf16 (no float32 base weight), so the residual stream stays bf16; the loss and the LoRA gradients of a
    bf16-autocast step (with the run's mixed paths) stay within :data:`RESIDUAL_REL` of the float32 model's, as
    those of the float32 upcast (``float32``, peft's ``prepare_model_for_kbit_training``) do."""
    pytest.importorskip("bitsandbytes")
    from scale.training.checks import dtype_census

    def build(residual: str) -> torch.nn.Module:
        cfg = ModelConfig(name_or_path="tiny-llama", quantize_4bit=True, gradient_checkpointing=False,
                          dtype="bfloat16", bnb_4bit_compute_dtype="bfloat16", qlora_residual_dtype=residual)
        model = modeling.build_model(cfg, LoraConfig(r=4, alpha=8.0, dropout=0.0), vocab_size=V, seed=0,
                                     device_map={"": 0} if device == "cuda" else None)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        mixed_paths.use_mixed_paths(model, mixed_paths.paths_for(device))
        return model

    def loss_and_grads(model, autocast=True):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=3).logits
        loss = logits.float().pow(2).mean()
        loss.backward()
        return loss.item(), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}

    ids = torch.randint(3, V, (4, 24), generator=torch.Generator().manual_seed(7)).to(device)
    upcast, compute = build("float32"), build("compute")
    assert "float32/frozen" in dtype_census(upcast) and "float32/frozen" not in dtype_census(compute)
    assert dtype_census(compute)["bfloat16/frozen"] == dtype_census(upcast)["float32/frozen"]
    ref_loss, ref = loss_and_grads(fp32_twin(upcast, device), autocast=False)
    for model in (upcast, compute):
        loss, grads = loss_and_grads(model)
        assert abs(loss - ref_loss) <= RESIDUAL_REL * abs(ref_loss), (loss, ref_loss)
        assert rel(grads, ref) <= RESIDUAL_REL, (rel(grads, ref), RESIDUAL_REL)


def test_the_planner_counts_the_unquantized_weights_in_the_residual_dtype():
    """scale-plan's census: a bf16-loaded 4-bit model's unquantized weights are float32 under the float32 upcast,
    bf16 under ``compute`` (the same tensors), the 4-bit and LoRA ones unchanged."""
    from scale.config.load import load_config
    from scale.planner import census

    counts = {}
    for residual in ("float32", "compute"):
        cfg = load_config(None, ["model.name_or_path=tiny-llama", "model.tokenizer=smollm2-135m",
                                 "model.quantize_4bit=true", "model.dtype=bfloat16",
                                 f"model.qlora_residual_dtype={residual}"])
        params = census.census(cfg, census.build_meta_model(cfg, census.load_model_config(cfg.model)))
        counts[residual] = collections.Counter()
        for p in params:
            kind = "4bit" if p.quantized else "lora" if p.trainable else str(p.dtype)
            counts[residual][kind] += torch.Size(p.shape).numel()
    up, compute = counts["float32"], counts["compute"]
    assert up["4bit"] == compute["4bit"] > 0 and up["lora"] == compute["lora"] > 0
    assert up["torch.float32"] == compute["torch.bfloat16"] > 0
    assert up["torch.bfloat16"] == 0 and compute["torch.float32"] == 0


def test_the_tiny_qlora_job_trains_with_its_residual_stream_in_bf16(tmp_path, caplog):
    """``scale.train.run`` on the tiny job, QLoRA loaded in bf16 under bf16 autocast, with each residual dtype: the
    start-up line names the frozen unquantized weights' dtype (bf16 under ``compute``: no float32 base weight), the
    first logged loss (before any update) agrees within :data:`RESIDUAL_REL`, and the loss falls in both."""
    pytest.importorskip("bitsandbytes")
    import logging

    from benchmarks.common import reset_accelerate
    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import tiny_cfg

    losses, lines = {}, {}
    for residual in ("float32", "compute"):
        reset_accelerate()
        caplog.clear()
        out = tmp_path / residual
        with caplog.at_level(logging.INFO):
            run(tiny_cfg(out, "model.quantize_4bit=true", "model.dtype=bfloat16",
                         "model.bnb_4bit_compute_dtype=bfloat16", "train.mixed_precision=bf16",
                         f"model.qlora_residual_dtype={residual}", "train.max_steps=8", "train.log_every=1",
                         "train.eval_every=0"))
        lines[residual] = next(r.getMessage() for r in caplog.records if "parameter dtypes" in r.getMessage())
        losses[residual] = [r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert "'float32/frozen'" in lines["float32"] and "'bfloat16/frozen'" not in lines["float32"], lines
    assert "'bfloat16/frozen'" in lines["compute"] and "'float32/frozen'" not in lines["compute"], lines
    a, b = losses["float32"], losses["compute"]
    assert abs(a[0] - b[0]) <= RESIDUAL_REL * abs(a[0]), (a, b)
    assert a[-1] < a[0] and b[-1] < b[0], (a, b)
