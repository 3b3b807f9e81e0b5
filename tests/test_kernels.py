"""``model.kernels: liger``: refused in one line on CPU and without liger-kernel; which model family maps to which
Liger apply function; on a GPU (``-m gpu``), the patched model's loss and LoRA gradients against the unpatched one."""

from __future__ import annotations

import pytest
import torch

from scale.config.validation import ConfigError
from scale.modeling import kernels
from scale.utils.wrapped import base_model
from tests.bounds import EPS32, fp32_paths_rel
from tests.conftest import tiny_cfg

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _config(family: str):
    import transformers

    from tests.test_families import FAMILIES

    cls, kwargs = FAMILIES[family]
    return getattr(transformers, cls)(**kwargs)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"])
def test_each_family_maps_to_its_liger_apply_function(family):
    """The dispatch table picks the function by ``config.model_type``, through peft's wrapper; where liger-kernel is
    installed, it is the function Liger's own table (``MODEL_TYPE_TO_APPLY_LIGER_FN``) names for that type."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = _config(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    assert base_model(wrapped) is model
    assert kernels.liger_apply_name(wrapped) == kernels.LIGER_APPLY[family] == f"apply_liger_kernel_to_{family}"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:  # no liger-kernel (no Triton, no GPU): the names alone
        return
    assert MODEL_TYPE_TO_APPLY_LIGER_FN[family].__name__ == kernels.LIGER_APPLY[family]


def test_a_family_without_liger_kernels_is_refused_in_one_line():
    import transformers

    from tests.test_families import FAMILIES

    cls, kwargs = FAMILIES["gpt2"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs))
    with pytest.raises(ConfigError) as e:
        kernels.apply_kernels(model, "liger")
    assert str(e.value) == ("model.kernels=liger has no kernels for model type 'gpt2' (it patches gemma, gemma2, "
                            "granite, llama, mistral, olmo2, phi3, qwen2, qwen3, smollm3); set model.kernels=null")
    assert kernels.apply_kernels(model, None) == []  # null patches nothing


def test_each_apply_function_gets_the_norm_mlp_and_rope_kernels_it_takes():
    """Liger's functions differ in their keywords (Gemma's MLP is a GeGLU): each gets those it takes, the loss
    patches off (the tail loss is this harness's)."""
    def llama_like(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                   model=None):
        pass

    def gemma_like(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True,
                   model=None):
        pass

    assert kernels.liger_kwargs(llama_like) == {"rope": True, "rms_norm": True, "swiglu": True,
                                                "cross_entropy": False, "fused_linear_cross_entropy": False}
    assert kernels.liger_kwargs(gemma_like) == {"rope": True, "rms_norm": True, "geglu": True,
                                                "cross_entropy": False, "fused_linear_cross_entropy": False}


@pytest.mark.skipif(torch.cuda.is_available(), reason="model.kernels=liger is refused on CPU only")
def test_liger_kernels_on_cpu_are_refused_before_anything_is_written(tmp_path):
    from scale.train import run

    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        run(tiny_cfg(out, "model.kernels=liger"))
    assert str(e.value) == ("model.kernels=liger needs a CUDA GPU (Liger-Kernel's Triton kernels); on CPU set "
                            "model.kernels=null (transformers' own RMSNorm, SwiGLU and RoPE)")
    assert not out.exists()


def test_an_unknown_kernels_value_is_refused():
    from scale.config.load import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.kernels=triton"])
    assert str(e.value) == "model.kernels='triton' is not one of [None, 'liger']"


# ------------------------------------------------------------------------------------------------------ GPU

def _lora_step(model, ids) -> tuple[float, dict[str, torch.Tensor]]:
    """float32 loss ``mean(tail logits ** 2)`` and the LoRA gradients (float64 copies) of one step."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=3).logits
    loss = logits.float().pow(2).mean()
    loss.backward()
    return loss.item(), {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.gpu
@needs_cuda
def test_liger_kernels_match_the_unpatched_model_in_fp32(monkeypatch):
    """Tiny Llama + LoRA in float32 on the GPU (TF32 off), one step before and after Liger's RMSNorm, SwiGLU and
    RoPE kernels are patched in: the same maths (Liger's "llama" casting mode normalises in float32, as
    ``LlamaRMSNorm`` does; SwiGLU and RoPE are elementwise), summed in other orders, so the loss and each LoRA
    gradient are within ``fp32_paths_rel(V, H)`` (tests/bounds.py: the vocabulary reduction and the hidden-width
    dot products) of each other, relative to the quantity's largest element."""
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # Liger rebinds these module-wide: undone
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from scale.config.schema import LoraConfig, ModelConfig
    from scale.modeling import build as modeling

    V, H = 300, 64
    model = modeling.build_model(ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=False,
                                             tiny_hidden_size=H), LoraConfig(r=4, alpha=8.0, dropout=0.0), V, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    model.cuda()
    ids = torch.randint(3, V, (4, 24), generator=torch.Generator().manual_seed(7)).cuda()
    loss, grads = _lora_step(model, ids)
    applied = kernels.apply_kernels(model, "liger")
    assert applied == ["liger rope", "liger rms_norm", "liger swiglu"], applied
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    base = model.get_base_model().model  # Liger rebinds the instances' forward, the classes stay
    assert base.norm.forward.__func__ is LigerRMSNorm.forward
    assert base.layers[0].mlp.forward.__func__ is LigerSwiGLUMLP.forward
    liger_loss, liger_grads = _lora_step(model, ids)
    r = fp32_paths_rel(V, H)
    assert abs(liger_loss - loss) <= r * abs(loss) + EPS32, (liger_loss, loss, r)
    for n, g in grads.items():
        diff = float((liger_grads[n] - g).abs().max())
        assert diff <= r * float(g.abs().max()), (n, diff, float(g.abs().max()), r)


@pytest.mark.gpu
@needs_cuda
def test_liger_kernels_train_the_tiny_job_as_the_unpatched_one(tmp_path):
    """The tiny job through ``scale.train.run`` with ``model.kernels=liger`` (bf16 autocast) and without: the same
    first logged loss within the bf16 round-off of the roundings on its path (tests/test_mixed_paths.GRAD_REL: the
    two runs round the norm and MLP outputs at other points, the cross-entropy itself is float32), and the loss
    falls in both."""
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    from benchmarks.common import reset_accelerate
    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.test_mixed_paths import GRAD_REL

    saved = {n: getattr(modeling_llama, n) for n in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    losses = {}
    try:
        for kernel in ("null", "liger"):
            reset_accelerate()
            out = tmp_path / kernel
            run(tiny_cfg(out, f"model.kernels={kernel}", "train.mixed_precision=bf16", "train.max_steps=8",
                         "train.log_every=1"))
            losses[kernel] = [r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    finally:
        for n, v in saved.items():
            setattr(modeling_llama, n, v)
    a, b = losses["null"], losses["liger"]
    assert abs(a[0] - b[0]) <= GRAD_REL * abs(a[0]), (a, b)
    assert a[-1] < a[0] and b[-1] < b[0], (a, b)
