"""What a preference job adds to the plan: ``P`` pairs of a micro-batch counted as ``2P`` rows (:func:`pair_rows`),
the in-step reference forward's peak or the pre-pass of ``loss.reference: precomputed``, the starting adapter's
frozen copy, and the FLOPs per pair (:func:`plan_pairs`); a full run's frozen reference per rank
(:func:`frozen_reference_bytes`, DPO's ``loss.reference: model`` and GRPO's ``rl.beta`` > 0).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from scale.config.schema import Config
from scale.objectives.preference import REFERENCE_ADAPTER
from scale.planner.activations import Activations, count_reference_peak
from scale.planner.census import ParamInfo, nbytes
from scale.utils.flops import flops_per_token, model_shape, reference_flops_per_token

def pair_rows(cfg: Config) -> Config:
    """A preference job as the planner counts it: a micro-batch of ``P`` pairs (``train.micro_batch_size``) is
    ``2P`` rows of prompt + completion (:class:`scale.data.tasks.preference.PairCollator`: rows ``2p``, ``2p + 1``),
    and the preference losses run unchunked (``loss.chunk_size`` 0: :func:`scale.objectives.pair_losses.side_logps`
    over the ``[2P, N, V]`` tail logits)."""
    return replace(cfg, train=replace(cfg.train, micro_batch_size=2 * cfg.train.micro_batch_size),
                   loss=replace(cfg.loss, chunk_size=0))


def plan_pairs(user_cfg: Config, cfg: Config, model: torch.nn.Module, params: list[Any],
               acts: dict[bool, Activations], cast: torch.dtype | None, counts: dict[str, int]) -> dict[str, Any]:
    """What a preference job adds to the plan, and the in-step reference's bytes set on ``acts`` (``reference``).

    - **Two sides per pair**: ``cfg`` is :func:`pair_rows`'s (``2P`` rows); the activations, logits and loss
      backward are counted for them.
    - **The reference** (``dpo``): ``loss.reference: adapter`` runs one more forward of the ``2P`` rows per
      micro-batch under ``no_grad`` after the policy's, while the policy's saved activations are alive: its peak
      (:func:`scale.planner.activations.count_reference_peak`: tail logits, logsumexp's buffer, one layer's
      intermediates) is a transient of the step (``Activations.reference``, :func:`scale.planner.layouts.predict_mode`
      takes the larger of it and the loss backward). ``precomputed``: nothing in the step; one pass before training over
      every train and eval pair, ``2 x train.eval_micro_batch_size`` rows at a time, with no gradients or optimizer
      state yet.
    - **A frozen copy** (``loss.reference: model``, full weights): the same in-step forward, from a second copy of
      every weight, counted per rank by :func:`frozen_reference_bytes` (``Rank.reference``).
    - **A starting adapter** (``model.adapter``) under the in-step reference: its frozen copy, the peft adapter
      ``reference`` (:func:`scale.objectives.preference.add_reference_adapter`), is appended to ``params`` as frozen
      parameters of the LoRA matrices' shapes and dtypes, so every launch mode holds (or shards) it as weights.
    - **FLOPs per pair**: the policy's training FLOPs of both sides (``2 T`` positions x
      :func:`scale.utils.flops.flops_per_token`) and the reference's forward
      (:func:`scale.utils.flops.reference_flops_per_token`) in the
      step or once in the pre-pass.

    Args:
        user_cfg: the config as given (``train.micro_batch_size`` in pairs).
        cfg: the planned config (:func:`pair_rows` of :func:`scale.planner.plan.with_tail`'s).
        model: the meta-built model (:func:`scale.planner.census.build_meta_model`).
        params: its :func:`scale.planner.census.census`; the reference adapter's copies are appended (see above).
        acts: the activations by precision regime (as :func:`scale.planner.layouts.predict_mode` reads them); their
            ``reference`` is set.
        cast: the DeepSpeed regime's parameter dtype, or None.
        counts: examples per split (:func:`scale.planner.plan.data_tail`), possibly empty.

    Returns:
        JSON-ready numbers (bytes, FLOPs) and ``text``, the plan's line in words.
    """
    loss = cfg.loss
    P, rows, T, N = user_cfg.train.micro_batch_size, cfg.train.micro_batch_size, cfg.data.max_length, loss.threshold
    reference = loss.reference if loss.objective == "dpo" else "none"
    in_step = reference in ("adapter", "model")
    peak = {regime: count_reference_peak(cfg, model, params, cast if regime else None) for regime in (False, True)
            } if in_step else {False: 0, True: 0}
    for regime, a in acts.items():
        a.reference = peak[regime]
    if in_step and cfg.model.adapter is not None:  # the starting adapter's frozen copy: more (frozen) parameters
        params.extend(replace(p, name=p.name.replace(".default.", f".{REFERENCE_ADAPTER}."), trainable=False)
                      for p in list(params) if p.trainable)
    eval_rows = 2 * cfg.train.eval_micro_batch_size
    prepass = (count_reference_peak(cfg, model, params, None, rows=eval_rows) if reference == "precomputed" else 0)
    trainable = sum(p.numel for p in params if p.trainable)
    shape, f = model_shape(model), N / T
    policy = 2 * T * flops_per_token(shape, T, lora_params=trainable, logits_fraction=f)
    forward = 2 * T * reference_flops_per_token(shape, T, f, trainable if cfg.model.adapter else 0)
    train_pairs, eval_pairs = counts.get("train", 0) // 2, counts.get("eval", 0) // 2
    out = {"objective": loss.objective, "pairs_per_micro_batch": P, "rows_per_micro_batch": rows,
           "reference": reference, "reference_step_bytes": peak[False], "reference_pass_bytes": prepass,
           "reference_pass_rows": eval_rows if prepass else 0, "train_pairs": train_pairs, "eval_pairs": eval_pairs,
           "policy_flops_per_pair": policy, "reference_flops_per_pair": forward if reference != "none" else 0.0,
           "step_flops_per_pair": policy + (forward if in_step else 0.0),
           "reference_pass_flops": forward * (train_pairs + eval_pairs) if reference == "precomputed" else 0.0}
    ref_text = {"adapter": (f"loss.reference=adapter: one more forward of the {rows} rows per micro-batch under "
                            f"no_grad, {peak[False] / 2**20:.1f} MiB at its peak on top of the policy's saved "
                            f"activations (in 'transient'), {forward:.3g} FLOPs per pair"),
                "model": (f"loss.reference=model: a frozen copy of every weight (per rank: 'frozen reference'), one "
                          f"more forward of the {rows} rows per micro-batch under no_grad, "
                          f"{peak[False] / 2**20:.1f} MiB at its peak on top of the policy's saved activations (in "
                          f"'transient'), {forward:.3g} FLOPs per pair"),
                "precomputed": (f"loss.reference=precomputed: nothing in the step; one pass before training over "
                                f"{train_pairs + eval_pairs} pairs ({eval_rows} rows at a time, "
                                f"{prepass / 2**20:.1f} MiB at its peak on top of the weights), "
                                f"{out['reference_pass_flops']:.3g} FLOPs once"),
                "none": f"loss.objective={loss.objective}: reference-free"}[reference]
    out["text"] = (f"preference pairs ({loss.objective}): a micro-batch of {P} pairs is {rows} rows (chosen and "
                   f"rejected each prompt + completion); {ref_text}; training FLOPs per pair "
                   f"{out['step_flops_per_pair']:.3g} (policy {policy:.3g} over 2 x {T} positions)")
    return out


def frozen_reference_bytes(params: list[ParamInfo], mode: str, world: int, cast: torch.dtype | None,
                           ds: dict[str, Any] | None = None) -> tuple[int, int]:
    """``(device, host)`` bytes one rank holds of a full run's frozen reference (:mod:`scale.distributed.frozen`
    builds it): every parameter again, in the dtype the forward reads (``cast`` under DeepSpeed bf16, else as
    loaded: fp32 for full weights). One device, DDP and ZeRO-1/2 (DeepSpeed stage 0): whole. ZeRO-3: each parameter's
    partition ``ceil(n / N)``, plus the whole of those DeepSpeed keeps gathered (``stage3_param_persistence_threshold``,
    the reference engine's own ``stage3_model_persistence_threshold``); with ``offload_param`` the partitions are in
    host memory. FSDP2: dim-0 shards padded to ``ceil(rows / N)`` rows (FSDP2 stores the padded rows).

    Args:
        params: the policy's :func:`scale.planner.census.census` (every weight: full fine-tune).
        mode: a :data:`scale.planner.layouts.MODES` name.
        world: processes.
        cast: DeepSpeed's mixed-precision dtype, or None.
        ds: ``deepspeed_settings(mode, ...)`` under ZeRO-3.
    """
    w = world if mode != "single" else 1
    if mode in ("zero3", "zero3_offload"):
        offload = (ds or {}).get("offload_param", {}).get("device", "none") == "cpu"
        device = host = persisted = 0
        for p in params:
            dtype = cast or p.dtype
            elems = p.numel
            persistent = (ds is not None and elems <= ds["stage3_param_persistence_threshold"]
                          and persisted + elems <= ds["stage3_model_persistence_threshold"])
            persisted += elems if persistent else 0
            part = _ceil_div(elems, w) * nbytes(dtype)
            if persistent:
                device += part + (_ceil_div(elems, w) * w * nbytes(dtype) if w > 1 else 0)
            elif offload:
                host += part
            else:
                device += part
        return device, host
    if mode == "fsdp2":
        out = 0
        for p in params:
            rows = p.shape[0] if p.shape else 1
            out += _ceil_div(rows, w) * (p.numel // max(rows, 1)) * nbytes(p.dtype)
        return out, 0
    dtype_of = (lambda p: cast) if mode in ("zero1", "zero2") and cast is not None else (lambda p: p.dtype)
    return sum(p.numel * nbytes(dtype_of(p)) for p in params), 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
