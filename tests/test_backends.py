"""Model build options: attention backend passed through and recorded, checkpointing variants exact, and
packing refused on families whose layers leak across packed examples."""

from __future__ import annotations

import pytest
import torch

from scale.config.load import load_config
from scale.config.schema import LoraConfig, ModelConfig
from scale.config.validation import ConfigError
from scale.data import Collator, Example
from scale.loss import tail as scale_loss
from scale.modeling.build import build_model

V = 300


def _examples():
    g = torch.Generator().manual_seed(5)
    return [Example(torch.randint(3, V, (n,), generator=g).tolist(), t, 0, 7, row=i)
            for i, (n, t) in enumerate(((12, 6), (7, 3), (15, 9)))]


def _loss_and_grads(model_cfg):
    model = build_model(model_cfg, LoraConfig(r=4, dropout=0.0), vocab_size=V, seed=0)
    batch = Collator(2, "left")(_examples())
    tail, targets = scale_loss.forward_tail(model, batch)
    num, den = scale_loss.tail_loss(tail, targets, batch["tail_mask"].float())
    (num / den).backward()
    return model, (num / den).item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attn_implementation_is_passed_and_recorded(impl):
    model, loss, _ = _loss_and_grads(ModelConfig(name_or_path="tiny-llama", attn_implementation=impl,
                                                 tiny_num_layers=4))
    assert model.get_base_model().config._attn_implementation == impl
    _, ref, _ = _loss_and_grads(ModelConfig(name_or_path="tiny-llama", tiny_num_layers=4))  # default: sdpa
    # eager and sdpa attention: two fp32 paths (tests/bounds.py) of a mean CE over the vocabulary
    from tests.bounds import fp32_paths_rel

    base = model.get_base_model().config
    assert loss == pytest.approx(ref, rel=fp32_paths_rel(base.vocab_size, base.intermediate_size), abs=0)


@pytest.mark.parametrize("variant", ["every_n", "offload"])
def test_checkpointing_variants_exact_against_no_checkpointing(variant):
    ref_model, ref, ref_g = _loss_and_grads(ModelConfig(name_or_path="tiny-llama", tiny_num_layers=4,
                                                        gradient_checkpointing=False))
    model, loss, grads = _loss_and_grads(ModelConfig(name_or_path="tiny-llama", tiny_num_layers=4,
                                                     gradient_checkpointing=variant, checkpoint_every_n_layers=2))
    layers = model.get_base_model().model.layers
    on = [bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers]
    assert on == ([True, False, True, False] if variant == "every_n" else [True] * 4)
    assert loss == ref
    for name, g in ref_g.items():   # recomputation runs the same operations again: bit-identical
        assert torch.equal(grads[name], g), name


def test_bad_backend_and_checkpointing_values_name_the_field():
    with pytest.raises(ConfigError, match="model.attn_implementation='flash3' is not one of"):
        load_config("tiny_cpu", ["model.attn_implementation=flash3"])
    with pytest.raises(ConfigError, match="model.gradient_checkpointing='sometimes' is not one of"):
        load_config("tiny_cpu", ["model.gradient_checkpointing=sometimes"])


@pytest.mark.parametrize("config_class,kw,named", [
    ("Qwen3_5TextConfig", dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
     "'qwen3_5_text' has 'linear_attention' layers"),
    ("Lfm2Config", dict(layer_types=["conv", "full_attention"]), "'lfm2' has 'conv' layers"),
    ("FalconH1Config", dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                            mamba_chunk_size=16), "'falcon_h1' has 'hybrid' layers"),
    ("LlamaConfig", {}, None),
    ("Gemma3TextConfig", dict(head_dim=16), None),
])
def test_padding_free_refused_on_families_whose_layers_leak(config_class, kw, named):
    """Tiny configs of the hybrid families: refused with one line naming family and layer type; Llama/Gemma3 pass."""
    import transformers

    from scale.modeling.attention import check_packing, packing_leak

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=V)
    cfg = getattr(transformers, config_class)(**{**small, **kw})
    why = packing_leak(cfg)
    if named is None:
        assert why is None
        return
    assert named in why
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    check_packing(model, padding_free=False)
    with pytest.raises(ConfigError, match=f"data.padding_free=true cannot be exact here: model type {named}"):
        check_packing(model, padding_free=True)
    with pytest.raises(ConfigError, match=f"data.packing=true cannot be exact here: model type {named}"):
        check_packing(model, padding_free=False, packing=True)


def test_flash_attention_without_flash_attn_is_one_line_before_anything_is_written(tmp_path, capsys):
    """transformers raises an ImportError from inside from_pretrained (after the data were tokenized); the run
    refuses at start in one line naming the key, what is missing and the kernels that run here."""
    import importlib.util

    from scale.cli import main
    from scale.modeling.attention import check_attention

    if importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available():
        pytest.skip("flash-attn runs on this machine")
    for ok in (None, "sdpa", "eager", "flex_attention"):
        check_attention(ModelConfig(attn_implementation=ok))  # nothing to check
    out = tmp_path / "out"
    assert main(["--config", "tiny_cpu", "model.attn_implementation=flash_attention_2", f"output_dir={out}",
                 "log.trackers=[]"]) == 2
    err = capsys.readouterr().err
    missing = ("the flash-attn package is not installed (pip install flash-attn, on a CUDA machine)"
               if importlib.util.find_spec("flash_attn") is None else "flash-attn needs a CUDA GPU and none is visible")
    assert err == (f"scale-train: error: ConfigError: model.attn_implementation=flash_attention_2 cannot run here: "
                   f"{missing}; kernels that run here: sdpa (null: transformers' default), eager, flex_attention; set "
                   f"model.attn_implementation=sdpa (or null)\n")
    assert not out.exists()
