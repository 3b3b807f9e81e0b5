"""What an online-RL job (``loss.objective: grpo``) adds to the plan: the rows it trains (prompt + completion, the
completion its tail: :func:`rl_rows`), the rollout's KV cache and sampling buffers, the forwards a round runs
without gradients (the round's own log-probs, the reference's), and the FLOPs of one optimizer step
(:func:`plan_rl`). Meta and fake tensors only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from scale.config.schema import Config
from scale.planner.activations import Activations, count_reference_peak
from scale.utils.flops import flops_per_token, model_shape, reference_flops_per_token

SAMPLING_COPIES = 4
"""``[rows, V]`` fp32 tensors alive at once while a token is sampled: the scores, the tempered and filtered ones,
their log-softmax and the Gumbel noise (:class:`scale.generation.rollout.SeededSampler`)."""


def rl_tail(cfg: Config) -> tuple[int, str]:
    """``N``: the tail positions per row (a completion: ``rl.max_completion_length``), and the assumption in words."""
    n = cfg.rl.max_completion_length
    return n, (f"tail: N = rl.max_completion_length = {n} positions per row, each row a prompt + its completion of "
               f"at most data.max_length={cfg.data.max_length} tokens (the completion is the tail)")


def rl_rows(cfg: Config) -> Config:
    """A GRPO job as the planner counts its step: micro-batches of completion rows whose loss holds the tail's
    ``[B, N, V]`` fp32 logits at once (:func:`scale.objectives.grpo.token_logps`: unchunked)."""
    return replace(cfg, loss=replace(cfg.loss, chunk_size=0))


def _kv_bytes(hf_config: Any, rows: int, positions: int, dtype: torch.dtype) -> int:
    """The KV cache of ``rows`` sequences of ``positions`` tokens: ``2 x layers x kv_heads x head_dim`` per token."""
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * rows * positions * torch.finfo(dtype).bits // 8


def plan_rl(cfg: Config, model: torch.nn.Module, hf_config: Any, params: list[Any], acts: dict[bool, Activations],
            cast: torch.dtype | None) -> dict[str, Any]:
    """What a GRPO job adds to the plan, and its between-steps peak set on ``acts`` (``reference``).

    - **Sampling** (once per round, between optimizer steps): ``rl.steps_per_generation x micro_batch_size`` rows
      per rank in one ``generate`` call, each of at most ``data.max_length`` tokens: their KV cache in the compute
      dtype, :data:`SAMPLING_COPIES` ``[rows, V]`` fp32 buffers per token and the prefill's one-layer intermediates
      (:func:`scale.planner.activations.count_reference_peak` of those rows with one position kept, as ``generate``
      keeps the last).
    - **Forwards without gradients** (once per round, one micro-batch at a time): the round's own log-probs when a
      round spans more than one optimizer step, the reference's when ``rl.beta`` > 0: each
      :func:`count_reference_peak` of a micro-batch.
    - The larger of the two is set as the step's ``reference`` transient (:func:`scale.planner.layouts.predict_mode`
      takes the larger of it and the loss backward, on top of the saved activations): an upper bound, since both run
      between steps, when no activations are saved.
    - **FLOPs per optimizer step**: training every completion (``T`` positions x :func:`flops_per_token`), sampling
      (a forward over ``T`` positions per completion, :func:`reference_flops_per_token` with one position's logits),
      and each forward without gradients (the tail's logits).

    Returns:
        JSON-ready numbers (bytes, FLOPs) and ``text``, the plan's line in words.
    """
    rl, t = cfg.rl, cfg.train
    mb, ga = t.micro_batch_size, t.gradient_accumulation_steps
    spg = rl.steps_per_generation or ga
    rows, T, N = mb * spg, cfg.data.max_length, rl.max_completion_length
    compute = cast or {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.mixed_precision) or torch.float32
    vocab = next(iter(acts.values())).vocab
    kv = _kv_bytes(hf_config, rows, T, compute)
    sampling = SAMPLING_COPIES * rows * vocab * 4
    needs_old = ga % (spg * rl.num_iterations) != 0
    extra = int(needs_old) + int(rl.beta > 0)
    one_kept = replace(cfg, loss=replace(cfg.loss, threshold=1, target_position=-1))
    peaks = {}
    for regime, a in acts.items():
        prefill = count_reference_peak(one_kept, model, params, cast if regime else None, rows=rows)
        forward = count_reference_peak(cfg, model, params, cast if regime else None) if extra else 0
        peaks[regime] = (kv + sampling + prefill, forward)
        a.reference = max(a.reference, *peaks[regime])
    trainable = sum(p.numel for p in params if p.trainable)
    shape = model_shape(model)
    completions = mb * ga
    train = completions * T * flops_per_token(shape, T, lora_params=trainable, logits_fraction=N / T)
    generate = completions * T * reference_flops_per_token(shape, T, 1 / T, 0)
    forwards = extra * completions * T * reference_flops_per_token(shape, T, N / T, 0)
    gen_peak, fwd_peak = peaks[False]
    out = {"rows_per_round": rows, "kv_cache_bytes": kv, "sampling_bytes": sampling, "generation_peak_bytes": gen_peak,
           "no_grad_forwards_per_round": extra * spg, "no_grad_forward_bytes": fwd_peak,
           "train_flops_per_step": train, "generation_flops_per_step": generate, "no_grad_flops_per_step": forwards,
           "step_flops": train + generate + forwards}
    what = " + ".join(w for w, on in (("the round's log-probs", needs_old), ("the reference's", rl.beta > 0)) if on)
    out["text"] = (f"online RL (grpo): each round samples {rows} completions per rank at once (rl.steps_per_generation "
                   f"{spg} x micro_batch_size {mb}): KV cache {kv / 2**20:.1f} MiB + sampling buffers "
                   f"{sampling / 2**20:.1f} MiB, {gen_peak / 2**20:.1f} MiB at its peak"
                   + (f"; {what}: {extra * spg} forward(s) per round without gradients, {fwd_peak / 2**20:.1f} MiB at "
                      f"the peak" if extra else "")
                   + f" (between steps; planned in 'transient'); FLOPs per step {out['step_flops']:.3g} (training "
                     f"{train:.3g}, sampling {generate:.3g}, forwards without gradients {forwards:.3g})")
    return out
