"""``scale-plan`` for preference jobs: two sides per pair, the DPO reference's pass, FLOPs per pair.

- The plan of a tiny DPO/SimPO job (single device, no overhead) against the peak of live tensor bytes over a real
  optimizer step of the objective's own ``loss_step`` (:func:`tests.test_plan.live_step_peak`'s measure), within the
  planner's stated 10%.
- plan(dpo, P pairs) against plan(sft, 2P rows) on the same data: the same model states, saved decoder activations
  and logits; the in-step reference adds exactly its counted forward peak to the transient bytes when that is the
  larger; the FLOPs per pair are 2T positions of training FLOPs plus 2T of forward FLOPs, recomputed here from the
  hand count of the model (:func:`scale.utils.flops.param_counts`).
"""

from __future__ import annotations

import json

import pytest
import torch

from scale.config.load import load_config
from scale.plan import format_plan
from scale.planner import activations as A
from scale.planner import census as C
from scale.planner import plan as P
from scale.utils import flops as F
from tests.conftest import TINY_YAML
from tests.live_bytes import LiveBytes

PAIRS = 4      # pairs per micro-batch
T = 64         # data.max_length
BASE = ["log.trackers=[]", "train.gradient_accumulation_steps=1", f"train.micro_batch_size={PAIRS}",
        f"data.max_length={T}", "data.eval_size=8", "data.format=preference", "train.eval_micro_batch_size=4"]


def write_pairs(path) -> str:
    """40 text pairs of varied lengths (the longest tail: 12 tokens with EOS)."""
    rows = [{"prompt": f"Q: question number {i} about things?", "chosen": " A good answer" + " yes" * (i % 5),
             "rejected": " Bad" + " no" * (i % 7)} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


def config(pairs_path, *overrides: str):
    return load_config(TINY_YAML, [*BASE, f"data.path={pairs_path}", *overrides])


def pair_batch(rows: int, length: int, tail: int, ref: bool) -> dict[str, torch.Tensor]:
    """``rows`` random rows of ``length`` tokens (the first left-padded by 5), each trained on its last ``tail``
    tokens: the plan's worst-case micro-batch; with ``ref``, precomputed reference logps."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "tail_mask": torch.ones(rows, tail, dtype=torch.long),
             "pair_row": torch.arange(rows // 2)}
    if ref:
        batch["ref_logps"] = -torch.rand(rows, generator=g, dtype=torch.float64) * 40
    return batch


def live_pair_step_peak(cfg, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Peak live tensor bytes of the second of two real optimizer steps on ``batch``, through the preference
    objective's own ``loss_step`` (policy forward, the in-step reference forward when it has one, the loss), counting
    the weights, buffers and optimizer state as the plan does (as :func:`tests.test_plan.live_step_peak`)."""
    from scale.objectives.preference import PreferenceObjective
    from scale.training.parts.optimizer import make_optimizer

    model.train()
    objective = PreferenceObjective.from_config(cfg)
    optimizer, _ = make_optimizer(cfg, model)

    def step() -> None:
        weights = objective.weights(batch)
        (objective.loss_step(model, batch, weights) / weights.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
    live = LiveBytes(*model.parameters(), *model.buffers(), *states, *batch.values())
    with live:
        step()
    return live.peak


@pytest.mark.parametrize("objective,reference,checkpointing", [
    ("dpo", "adapter", True), ("dpo", "adapter", False), ("dpo", "precomputed", True), ("simpo", "adapter", False)])
def test_plan_of_a_tiny_preference_step_within_10_percent_of_live_tensor_bytes(pairs_path, objective, reference,
                                                                              checkpointing):
    from scale.modeling.build import build_model

    cfg = config(pairs_path, f"loss.objective={objective}", f"loss.reference={reference}",
                 f"model.gradient_checkpointing={str(checkpointing).lower()}")
    plan = P.make_plan(cfg, 1)
    predicted = plan.ranks[0]
    tail, _ = P.data_tail(cfg)
    assert plan.micro_batch_size == 2 * PAIRS and plan.preference["rows_per_micro_batch"] == 2 * PAIRS
    model = build_model(cfg.model, cfg.lora, C.TINY_VOCAB, 0)
    peak = live_pair_step_peak(cfg, model, pair_batch(2 * PAIRS, T, tail, ref=reference == "precomputed"))
    print(f"{objective}-{reference}-gc{checkpointing}: planned/measured {predicted.allocated / peak:.4f}")
    assert abs(predicted.allocated / peak - 1) < 0.10, (predicted.allocated / peak, predicted, peak)


def test_dpo_plan_is_the_sft_plan_of_twice_the_rows_plus_the_reference(pairs_path):
    sft = P.make_plan(config(pairs_path, "loss.objective=sft", f"train.micro_batch_size={2 * PAIRS}"), 2)
    pre = P.make_plan(config(pairs_path, "loss.objective=dpo", "loss.reference=precomputed"), 2)
    ada = P.make_plan(config(pairs_path, "loss.objective=dpo", "loss.reference=adapter"), 2)
    simpo = P.make_plan(config(pairs_path, "loss.objective=simpo"), 2)
    rows = 2 * PAIRS
    tail, _ = P.data_tail(config(pairs_path))
    V = C.TINY_VOCAB
    for plan in (pre, ada, simpo):
        assert plan.micro_batch_size == rows
        assert {k: plan.activations[k] for k in ("checkpointing_off", "checkpointing_on")} == \
               {k: sft.activations[k] for k in ("checkpointing_off", "checkpointing_on")}
        assert plan.logits_tail_bytes == sft.logits_tail_bytes == rows * tail * V * 4
        for r, s in zip(plan.ranks, sft.ranks):
            assert r.mode == s.mode
            assert (r.weights, r.trainable, r.master, r.gradients, r.optimizer) == \
                   (s.weights, s.trainable, s.master, s.gradients, s.optimizer)
            assert r.activations == s.activations
    # The pairs' loss keeps the [2P, N, V] fp32 tail logits (side_logps' log-softmax), as the SFT loss keeps its
    # [2P x N, V] log-softmax: the same bytes (plus at most 4 KiB of small tensors: targets, masks, sums).
    for r, s in zip(pre.ranks, sft.ranks):
        assert abs(r.logits - s.logits) <= 4096 and r.transient == s.transient
    # The in-step reference: its forward's peak holds the [2P, N, V] fp32 tail logits at least, and the step's
    # transient is the larger of it and the loss backward (what the plan without a reference holds).
    assert abs(pre.activations["lm_head_and_loss"] - sft.activations["lm_head_and_loss"]) <= 4096
    step_ref = ada.preference["reference_step_bytes"]
    assert step_ref >= rows * tail * V * 4
    assert pre.preference["reference_step_bytes"] == simpo.preference["reference_step_bytes"] == 0
    core = {r.mode: r for r in pre.ranks}["single"].transient  # max(recomputed layer, loss backward 3 x [2P x N, V])
    assert core >= 3 * rows * tail * V * 4
    for r, s in zip(ada.ranks, pre.ranks):  # every mode adds the same: the reference when it is the larger
        assert r.transient - s.transient == max(core, step_ref) - core
    # The pre-pass: 2 x eval_micro_batch_size rows at a time, over the 32 train and 8 eval pairs (data.eval_size
    # counts pairs).
    assert pre.preference["reference_pass_rows"] == 8 and pre.preference["train_pairs"] == 32
    assert pre.preference["eval_pairs"] == 8 and pre.preference["reference_pass_bytes"] >= 8 * tail * V * 4
    # FLOPs per pair from the hand count: 2T positions of LoRA training FLOPs (4 (N + f N_head) + 6 N_lora +
    # 12 L T d) and, for the reference, 2T positions of forward FLOPs (2 (N + f N_head) + 4 L T d).
    cfg = config(pairs_path)
    hf = C.load_model_config(cfg.model)
    counts = F.param_counts(hf)
    lora = sum(p.numel for p in C.census(cfg, C.build_meta_model(cfg, hf)) if p.trainable)
    f = tail / T
    d = hf.num_attention_heads * (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    attention = hf.num_hidden_layers * T * d
    train = 4 * (counts.layers + f * counts.head) + 6 * lora + 12 * attention
    forward = 2 * (counts.layers + f * counts.head) + 4 * attention
    # float64 sums of < 10 terms of size <= 1e9: exact to far below 1 FLOP; rel 1e-12 covers the rounding
    assert pre.preference["step_flops_per_pair"] == pytest.approx(2 * T * train, rel=1e-12)
    assert simpo.preference["step_flops_per_pair"] == pytest.approx(2 * T * train, rel=1e-12)
    assert ada.preference["step_flops_per_pair"] == pytest.approx(2 * T * (train + forward), rel=1e-12)
    assert pre.preference["reference_pass_flops"] == pytest.approx(40 * 2 * T * forward, rel=1e-12)
    assert "a micro-batch of 4 pairs is 8 rows" in format_plan(ada)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_counted_reference_peak_equals_a_real_reference_forward(pairs_path, checkpointing):
    """The reference forward's peak as the plan counts it (fake tensors,
    :func:`scale.planner.activations.count_reference_peak`) against the peak of live tensor bytes over the product's own
    in-step reference (``reference_forward``: adapter disabled, no_grad, summed tail logps) on a real ``[2P, T]``
    micro-batch: the same operations on the same shapes, so the same storages, plus the ``[2P, N, V]`` fp32 buffer
    ``torch.logsumexp`` allocates inside its kernel (which a dispatch mode cannot see, so the plan adds it); within 2%
    (the real forward's RoPE tables and masks are built from the batch's values)."""
    from scale.modeling.build import build_model
    from scale.objectives.preference import reference_forward

    cfg = config(pairs_path, f"model.gradient_checkpointing={str(checkpointing).lower()}")
    tail, _ = P.data_tail(cfg)
    planned_cfg = P.pair_rows(P.with_tail(cfg, tail))
    hf = C.load_model_config(cfg.model)
    meta = C.build_meta_model(planned_cfg, hf)
    counted = A.count_reference_peak(planned_cfg, meta, C.census(planned_cfg, meta))
    model = build_model(cfg.model, cfg.lora, C.TINY_VOCAB, 0)
    model.train()
    batch = pair_batch(2 * PAIRS, T, tail, ref=False)
    live = LiveBytes(*model.parameters(), *model.buffers(), *batch.values())
    with live:
        reference_forward(model, batch)
    inside = 2 * PAIRS * tail * C.TINY_VOCAB * 4  # logsumexp's exp(x - max), unseen by LiveBytes
    real = live.peak - live.before + inside
    assert abs(counted / real - 1) < 0.02, (counted, real)
    assert counted >= 2 * PAIRS * tail * C.TINY_VOCAB * 4  # at least its fp32 tail logits


def test_a_starting_adapter_adds_its_frozen_copy_and_its_forward(pairs_path):
    """model.adapter under the in-step reference: the reference is the starting adapter's frozen copy (a second peft
    adapter of the LoRA matrices' shapes): one more copy of the trainable bytes held as frozen weights in single and
    DDP, and the reference forward runs the adapter too (2 x its parameters FLOPs per position, 2T positions)."""
    plain = P.make_plan(config(pairs_path, "loss.objective=dpo"), 2)
    start = P.make_plan(config(pairs_path, "loss.objective=dpo", "model.adapter=runs/sft/adapter"), 2)
    pre = P.make_plan(config(pairs_path, "loss.objective=dpo", "model.adapter=runs/sft/adapter",
                             "loss.reference=precomputed"), 2)
    lora_bytes = {r.mode: r for r in plain.ranks}["single"].trainable  # fp32 LoRA matrices, not sharded
    assert lora_bytes == 4 * plain.trainable_parameters
    for a, b in zip(plain.ranks, start.ranks):
        if a.mode in ("single", "ddp"):
            assert b.weights - a.weights == lora_bytes
        assert (b.trainable, b.gradients, b.optimizer) == (a.trainable, a.gradients, a.optimizer)
    assert start.parameters == plain.parameters + plain.trainable_parameters
    assert pre.parameters == plain.parameters  # precomputed: no reference adapter is kept
    extra = start.preference["reference_flops_per_pair"] - plain.preference["reference_flops_per_pair"]
    assert extra == pytest.approx(2 * T * 2 * plain.trainable_parameters, rel=1e-12)


def test_packed_pairs_are_planned_as_bins_of_twice_the_rows(pairs_path):
    """``data.packing`` with pairs: ``P`` bins of up to ``2 x data.max_length`` tokens hold the tokens of ``2P``
    rows of ``data.max_length``: the decoder's activations equal the packed SFT plan of ``2P`` bins, and the note
    says what a bin is."""
    sft = P.make_plan(config(pairs_path, "loss.objective=sft", "data.packing=true",
                             f"train.micro_batch_size={2 * PAIRS}"), 1)
    dpo = P.make_plan(config(pairs_path, "loss.objective=dpo", "loss.reference=precomputed", "data.packing=true"), 1)
    assert dpo.micro_batch_size == 2 * PAIRS
    assert {k: dpo.activations[k] for k in ("checkpointing_off", "checkpointing_on")} == \
           {k: sft.activations[k] for k in ("checkpointing_off", "checkpointing_on")}
    T = config(pairs_path).data.max_length
    assert f"{PAIRS} bins of pairs x 2 x {T} tokens (planned as {2 * PAIRS} rows x {T})" in dpo.assumptions[0]
