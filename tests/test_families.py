"""Model families beyond Llama (issue 11, item 7): each trains two steps from a saved directory with the SmolLM2
tokenizer, gives the same numbers under left and right padding, gets a FLOPs count from its own layers, and its
adapter loads with plain peft and with transformers' load_adapter to the run's final evaluation.

The models are tiny (hidden 64, 2 layers), built from configs and saved to a temporary directory: no download.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from scale.config.validation import ConfigError
from scale.train import run
from scale.training.metrics import read_jsonl
from scale.utils.flops import model_shape, shape_from_config
from tests.bounds import TINY_JOB_REL
from tests.conftest import tiny_cfg
from tests.reload import reload_eval

V = 49152  # the SmolLM2 tokenizer's vocabulary
SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# name -> (config class, kwargs). Windows of 8 tokens are shorter than the rows (~20 tokens): the sliding-window
# masks are exercised. GPT-2's own dropout (0.1 by default) is off: the base's dropout masks depend on where the
# padding is, so left and right padding could not agree with it on.
FAMILIES = {
    "gpt2": ("GPT2Config", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                                eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "qwen2": ("Qwen2Config", SMALL),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=16)),
    "gemma": ("GemmaConfig", dict(SMALL, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(SMALL, head_dim=24, sliding_window=8)),  # head_dim != hidden / heads
    "phi3": ("Phi3Config", SMALL),  # fused qkv_proj and gate_up_proj
    "mistral": ("MistralConfig", dict(SMALL, sliding_window=8)),
    "llama": ("LlamaConfig", SMALL),
}
JOB = ["train.max_steps=2", "train.log_every=1", "train.eval_every=0", "data.eval_size=16",
       "data.max_train_examples=32", "train.save_every=0", "train.save_every_minutes=null",
       "model.tokenizer=smollm2-135m", "log.peak_flops=1e12",
       "optim.name=sgd", "optim.lr=0.5"]  # SGD: AdamW's m / sqrt(v) would blow up float noise of near-zero gradients


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> directory of a tiny model of that family (save_pretrained)."""
    import transformers

    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (config_cls, kwargs) in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**kwargs))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_trains_and_left_equals_right_padding(name, saved, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    results = {}
    for side in ("left", "right"):
        out = tmp_path / side
        final = run(tiny_cfg(out, *JOB, f"model.name_or_path={saved[name]}", f"data.padding_side={side}"))
        _reset()
        rows = read_jsonl(out / "metrics.jsonl")
        train = [r for r in rows if "train/loss" in r]
        results[side] = (final, train, load_file(out / "adapter" / "adapter_model.safetensors"))
    (final_l, train_l, ad_l), (final_r, train_r, ad_r) = results["left"], results["right"]
    assert [r["step"] for r in train_l] == [r["step"] for r in train_r] == [1, 2]
    for a, b in zip(train_l, train_r):
        assert _rel(a["train/loss"], b["train/loss"]) < 1e-5 and _rel(a["train/grad_norm"], b["train/grad_norm"]) < 1e-4
        assert a["train/mfu"] > 0  # the FLOPs count understood the family
    assert _rel(final_l["eval/loss"], final_r["eval/loss"]) < 1e-5 and final_l["eval/accuracy"] == final_r["eval/accuracy"]
    assert ad_l.keys() == ad_r.keys() and len(ad_l) > 0
    for k in ad_l:
        assert ((ad_l[k] - ad_r[k]).abs().max() / ad_l[k].abs().max()).item() < 1e-5, k
    assert not [r for r in caplog.records if "no FLOPs count" in r.getMessage()]
    # the adapter as its user loads it: plain peft, then transformers' load_adapter (last: it skips where that
    # transformers cannot run with the installed peft, tests/reload.py)
    for how in ("peft", "transformers"):
        again = reload_eval(tmp_path / "left", tmp_path / "left" / "adapter", how)
        assert _rel(final_l["eval/loss"], again["eval/loss"]) <= TINY_JOB_REL, (how, again, final_l)
        assert again["eval/accuracy"] == final_l["eval/accuracy"], how


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_flops_count_reads_every_matmul_of_the_family(name, saved):
    """model_shape counts every 2-D weight that is not an embedding: fused, transposed (Conv1D) and all."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(saved[name])
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings().weight
    matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings
                 and p is not head)
    shape = model_shape(get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")))
    assert shape.layers == matmul and shape.head == V * 64 and shape.num_layers == 2
    if name == "llama":
        assert shape == shape_from_config(model.config)  # the hand count of tests/test_flops.py agrees


def test_lora_target_names_of_another_family_are_one_line(saved, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        run(tiny_cfg(out, *JOB, f"model.name_or_path={saved['gpt2']}", "lora.target_modules=[q_proj,v_proj]"))
    assert str(e.value) == ("lora.target_modules: ['q_proj', 'v_proj'] match no linear layer of this "
                            "GPT2LMHeadModel; its linear layers are ['c_attn', 'c_fc', 'c_proj'] (or use all-linear)")
    assert not out.exists()


def test_a_failing_flops_count_never_stops_training(saved, tmp_path, monkeypatch, caplog):
    import scale.training.parts.model

    def broken(model):
        raise AttributeError("'FancyConfig' object has no attribute 'intermediate_size'")

    monkeypatch.setattr(scale.training.parts.model, "model_shape", broken)
    caplog.set_level(logging.WARNING)
    final = run(tiny_cfg(tmp_path, *JOB, f"model.name_or_path={saved['llama']}"))
    warnings = [r.getMessage() for r in caplog.records if "no FLOPs count" in r.getMessage()]
    assert warnings == ["[RANK 0] no FLOPs count (train/mfu) for this model: AttributeError: 'FancyConfig' object has no "
                        "attribute 'intermediate_size'"]  # once
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and not any("train/mfu" in r for r in rows)
    assert final["eval/examples"] == 16
