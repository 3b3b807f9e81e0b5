"""bf16 on CPU: each mixed-precision path (scale.modeling.mixed_paths.MIXED_PATHS) against the bf16 maths it replaces
and the fp32 maths it approximates; ``train.mixed_precision: auto`` decided once (rank 0's choice on every rank) and
kept by a resume."""

from __future__ import annotations

import json

import pytest
import torch

from scale.config.schema import LoraConfig, ModelConfig
from scale.config.validation import ConfigError
from scale.modeling import build as modeling
from scale.modeling import mixed_paths
from tests.conftest import tiny_cfg
from tests.launching import accelerate_cmd, run_mode

V = 300
BF16 = torch.bfloat16


def _model(quantize: bool = True, seed: int = 0):
    """The tiny Llama + LoRA r=4 (bf16 compute when 4-bit), every ``lora_B`` drawn non-zero so that every LoRA
    tensor gets a gradient."""
    cfg = ModelConfig(name_or_path="tiny-llama", quantize_4bit=quantize, gradient_checkpointing=False,
                      bnb_4bit_compute_dtype="bfloat16" if quantize else "float32")
    model = modeling.build_model(cfg, LoraConfig(r=4, alpha=8.0, dropout=0.0), vocab_size=V, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _ids(rows: int = 4, length: int = 24):
    return torch.randint(3, V, (rows, length), generator=torch.Generator().manual_seed(7))


def _grads(model, ids, autocast: bool = True, keep: int = 3):
    """(tail logits as float32, LoRA gradients) of one forward/backward, the forward under CPU bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=keep).logits
    logits.float().pow(2).mean().backward()
    return logits.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                                     if p.requires_grad}


def _rel(a: dict, b: dict) -> float:
    return float(sum((a[n] - b[n]).pow(2).sum() for n in b) ** 0.5 / sum(b[n].pow(2).sum() for n in b) ** 0.5)


pytest.importorskip("bitsandbytes")


def _fp32_twin(q):
    """The fp32 model holding ``q``'s dequantized 4-bit weights and its LoRA weights: the maths bf16 approximates."""
    import bitsandbytes as bnb

    ref_model = _model(quantize=False)
    with torch.no_grad():
        deq = {n: bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
               for n, m in q.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
        for n, m in ref_model.named_modules():
            if n in deq:
                m.weight.copy_(deq[n])
    return ref_model


def test_head_cast_cache_is_bit_identical_and_follows_the_weight():
    model = _model()
    ids = _ids()
    ref_logits, ref = _grads(model, ids)
    assert mixed_paths.use_mixed_paths(model, ["head_cast_cached"]) == ["head_cast_cached"]
    head = model.get_base_model().get_output_embeddings()
    logits, got = _grads(model, ids)
    first = head._scale_cast[1]
    assert first.dtype == BF16 and first.data_ptr() != head.weight.data_ptr()
    _grads(model, ids)
    assert head._scale_cast[1] is first  # made once, kept between forwards
    assert torch.equal(logits, ref_logits) and all(torch.equal(got[n], ref[n]) for n in ref)
    with torch.no_grad():
        head.weight.mul_(2.0)  # a changed weight (its version moves) is cast again
    logits2, _ = _grads(model, ids)
    assert head._scale_cast[1] is not first and torch.equal(head._scale_cast[1], head.weight.detach().to(BF16))
    assert mixed_paths.use_mixed_paths(model, ["head_cast_cached"], on=False) == ["head_cast_cached"]
    assert "forward" not in vars(head) and not hasattr(head, "_scale_cast")
    assert torch.equal(_grads(model, ids)[0], logits2)


def test_dequantize_to_compute_dtype_gives_bit_identical_gradients():
    model = _model()
    ids = _ids()
    _, ref = _grads(model, ids)
    assert mixed_paths.dequantize_in_compute_dtype(model) == 14  # 2 layers x 7 linear
    states = [m.weight.quant_state for m in model.modules() if hasattr(getattr(m, "weight", None), "quant_state")]
    assert {s.dtype for s in states} == {BF16}
    _, got = _grads(model, ids)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert mixed_paths.dequantize_in_compute_dtype(model, on=False) == 14
    assert {s.dtype for s in states} == {torch.float32}  # the load dtype back


def test_mixed_sdpa_is_fp32_attention_below_the_threshold_and_sdpa_above():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _model(quantize=False).get_base_model().model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    for T in (24, mixed_paths.ATTENTION_FP32_BELOW):
        q, k, v = (torch.randn(2, 4, T, 16, generator=g) for _ in range(3))
        mask = torch.ones(2, 1, T, T, dtype=torch.bool).tril()
        with torch.autocast("cpu", dtype=BF16):
            got, _ = mixed_paths.mixed_sdpa(layer, q, k, v, mask)
            half, _ = sdpa_attention_forward(layer, q, k, v, mask)
        full, _ = sdpa_attention_forward(layer, q, k, v, mask)  # float32, no autocast
        assert got.dtype == half.dtype == BF16
        if T < mixed_paths.ATTENTION_FP32_BELOW:
            assert torch.equal(got, full.to(BF16))  # fp32 attention, rounded once at the end
            assert (got.float() - full).abs().max() <= (half.float() - full).abs().max()
        else:
            assert torch.equal(got, half)  # long keys: the bf16 kernel, unchanged


def test_mixed_sdpa_switch_is_not_saved(tmp_path):
    model = _model(quantize=False)
    base = model.get_base_model()
    assert base.config._attn_implementation == "sdpa"
    assert mixed_paths.use_mixed_sdpa(model) and base.config._attn_implementation == mixed_paths.MIXED_SDPA
    assert not mixed_paths.use_mixed_sdpa(model)  # already on
    ids = _ids()
    with torch.autocast("cpu", dtype=BF16):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.isfinite(out).all()
    base.config.save_pretrained(tmp_path)
    assert mixed_paths.MIXED_SDPA not in (tmp_path / "config.json").read_text()
    assert mixed_paths.use_mixed_sdpa(model, on=False) and base.config._attn_implementation == "sdpa"


def test_adapter_inputs_cast_once_stays_within_bf16_round_off_of_fp32():
    """The layer outputs stay bf16 (base + adapter summed in bf16); the gradients stay as close to the fp32 model's
    as the bf16 path without it (bf16 round-off), and the LoRA matmuls see the same bf16 input as before."""
    ids = _ids()
    q = _model()
    _, fp32 = _grads(_fp32_twin(q), ids, autocast=False)
    _, before = _grads(q, ids)
    seen = []
    hook = q.get_base_model().model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    assert mixed_paths.cast_adapter_inputs_once(q) == 14
    _, after = _grads(q, ids)
    hook.remove()
    assert seen == [(BF16, BF16)]
    base_diff, diff = _rel(before, fp32), _rel(after, fp32)
    assert 0 < base_diff < 2e-2 and diff < 2 * base_diff, (base_diff, diff)
    assert mixed_paths.cast_adapter_inputs_once(q, on=False) == 14
    _, again = _grads(q, ids)
    assert all(torch.equal(again[n], before[n]) for n in before)  # off is the old path, bit for bit


def test_adapter_sum_in_addmm_stays_within_bf16_round_off_and_falls_back_to_peft():
    ids = _ids()
    q = _model()
    _, fp32 = _grads(_fp32_twin(q), ids, autocast=False)
    logits_before, before = _grads(q, ids)
    assert mixed_paths.fuse_adapter_sum(q) == 14
    logits, after = _grads(q, ids)
    assert logits.shape == logits_before.shape
    assert _rel(after, fp32) < 2 * _rel(before, fp32) < 4e-2
    layer = q.get_base_model().model.layers[0].mlp.up_proj
    x = torch.randn(2, 5, layer.in_features)
    with torch.no_grad():  # outside autocast: peft's own forward, bit for bit
        assert torch.equal(layer(x), type(layer).forward(layer, x))
        with q.disable_adapter():  # adapters off: the base layer alone
            assert torch.equal(layer(x), layer.base_layer(x))
    assert mixed_paths.fuse_adapter_sum(q, on=False) == 14 and "forward" not in vars(layer)
    _, again = _grads(q, ids)
    assert all(torch.equal(again[n], before[n]) for n in before)


def test_all_paths_track_fp32_as_the_bf16_path_does():
    ids = _ids()
    q = _model()
    _, fp32 = _grads(_fp32_twin(q), ids, autocast=False)
    _, before = _grads(q, ids)
    assert sorted(mixed_paths.use_mixed_paths(q)) == sorted(mixed_paths.MIXED_PATHS)
    _, after = _grads(q, ids)
    assert _rel(after, fp32) < 2 * _rel(before, fp32) < 4e-2


# ------------------------------------------------------------------------------ train.mixed_precision: auto

def _fake_probe(monkeypatch, bf16_over_fp32: float) -> list[int]:
    """Make the start-up probe report bf16 GEMMs at ``bf16_over_fp32`` x fp32; return a call counter."""
    import scale.training.precision

    calls = [0]

    def fake(device, dtype, seconds=0.4, n=None):
        calls[0] += 1
        return 100e9 * (bf16_over_fp32 if dtype == BF16 else 1.0)

    monkeypatch.setattr(scale.training.precision, "measure_peak_flops", fake)
    return calls


def _reset():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


RESUME = ["train.mixed_precision=auto", "optim.schedule=constant", "data.max_train_examples=16", "train.max_steps=2",
          "train.save_every=2", "train.eval_every=0", "train.log_every=1", "log.peak_flops=1e12",
          "model.gradient_checkpointing=false"]


@pytest.mark.slow
def test_auto_precision_is_kept_on_resume_and_an_explicit_change_is_an_error(tmp_path, monkeypatch):
    from scale.train import run

    calls = _fake_probe(monkeypatch, 2.0)  # bf16 wins at start
    run(tiny_cfg(tmp_path, *RESUME))
    _reset()
    ckpt = tmp_path / "checkpoints" / "step_000002"
    assert json.loads((ckpt / "trainer_state.json").read_text())["mixed_precision"] == "bf16"
    assert "mixed_precision: bf16" in (tmp_path / "config.yaml").read_text()
    assert calls[0] == 2  # fp32 and bf16, once

    calls = _fake_probe(monkeypatch, 0.5)  # the probe now says fp32: the resumed run keeps bf16, unmeasured
    from scale.training.job import setup

    job = setup(tiny_cfg(tmp_path, *RESUME, "train.max_steps=4", "train.resume_from=latest"))
    assert (job.acc.mixed_precision, job.cfg.train.mixed_precision, job.state.mixed_precision) == ("bf16",) * 3
    assert calls[0] == 0
    job.acc.end_training()
    _reset()
    with pytest.raises(ConfigError, match="train.mixed_precision"):
        setup(tiny_cfg(tmp_path, *RESUME, "train.max_steps=4", "train.resume_from=latest",
                       "train.mixed_precision=no"))


def test_saved_precision_reads_the_state_then_the_saved_config(tmp_path):
    from scale.training.checkpoint import saved_precision
    from scale.training.state import STATE_FILE

    ckpt = tmp_path / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    assert saved_precision(None, tmp_path) is None
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 3, "config": {"train": {"mixed_precision": "no"}}}))
    assert saved_precision("latest", tmp_path) == "no"  # a checkpoint from before the field
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 3, "mixed_precision": "bf16",
                                               "config": {"train": {"mixed_precision": "bf16"}}}))
    assert saved_precision(str(ckpt), tmp_path) == "bf16"
    assert saved_precision(str(tmp_path / "nowhere"), tmp_path) is None  # check_resume reports it


@pytest.mark.launch
def test_auto_precision_is_rank_zeros_choice_on_every_rank(tmp_path):
    """Rank 0's probe says bf16, rank 1's says fp32: both ranks train in bf16, rank 1 never measures, and
    config.yaml and the checkpoint record bf16."""
    cmd = accelerate_cmd("cpu_ddp.yaml")
    cmd[-1] = "tests.precision_split"  # -m tests.precision_split: scale.train behind the fake per-rank probe
    run_mode([cmd], ["train.mixed_precision=auto", "train.max_steps=2", "train.save_every=2"], tmp_path)
    ranks = [json.loads((tmp_path / f"precision_rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["mixed_precision"], r["probes"]) for r in ranks] == [("bf16", 2), ("bf16", 0)], ranks
    assert "mixed_precision: bf16" in (tmp_path / "config.yaml").read_text()
    state = json.loads((tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["mixed_precision"] == "bf16" and state["config"]["train"]["mixed_precision"] == "bf16"
