"""``scale-plan`` for online RL (``loss.objective: grpo``): the rollout's KV cache and sampling buffers, the forwards
a round runs without gradients, and the FLOPs of one step, each against its hand count on the tiny model."""

from __future__ import annotations

import pytest

from scale.config.load import load_config
from scale.plan import format_plan
from scale.planner import plan as P
from scale.utils import flops as F
from tests.conftest import ROOT, TINY_YAML

JOB = ["log.trackers=[]", "loss.objective=grpo", "data.format=prompts", "rl.rewards=[{fn: exact_match}]",
       f"data.path={ROOT / 'configs' / 'data' / 'tiny_prompts.jsonl'}", "rl.num_generations=4",
       "train.micro_batch_size=8", "train.gradient_accumulation_steps=1", "rl.steps_per_generation=2",
       "rl.max_completion_length=8", "data.max_length=48", "train.mixed_precision=no"]


@pytest.fixture(scope="module")
def sft_plan():
    """The SFT plan of the same rows (8 x 48 tokens, the loss unchunked): what GRPO's transient is compared with."""
    return P.make_plan(load_config(TINY_YAML, ["log.trackers=[]", "train.micro_batch_size=8", "loss.chunk_size=0",
                                               "train.gradient_accumulation_steps=1", "data.max_length=48",
                                               "train.mixed_precision=no"]), 1, 80)


@pytest.mark.parametrize("beta, iterations, forwards", [(0.0, 1, 1), (0.04, 2, 2)])
def test_the_rollout_and_the_forwards_without_gradients_are_planned(sft_plan, beta, iterations, forwards):
    """tiny-llama (2 layers, 4 KV heads of 16, fp32): a round of 2 micro-batches of 8 samples 16 rows of 48
    positions at once: KV cache 2 x 2 x 4 x 16 x 16 x 48 x 4 bytes; 4 fp32 [16, V] sampling buffers; the round spans 2
    steps (its own log-probs: 1 forward per micro-batch) and beta > 0 adds the reference's; the step's transient holds
    the larger of the sampling peak and one such forward; FLOPs: training, sampling and those forwards per step from
    the hand count."""
    cfg = load_config(TINY_YAML, [*JOB, f"rl.beta={beta}", f"rl.num_iterations={iterations}"])
    plan = P.make_plan(cfg, gpus=1, gpu_mem_gib=80)
    rl = plan.rl
    V = 49152
    assert rl["rows_per_round"] == 16
    assert rl["kv_cache_bytes"] == 2 * 2 * 4 * 16 * 16 * 48 * 4
    assert rl["sampling_bytes"] == 4 * 16 * V * 4
    assert rl["no_grad_forwards_per_round"] == 2 * forwards
    assert rl["generation_peak_bytes"] > rl["kv_cache_bytes"] + rl["sampling_bytes"]
    single, base = plan.ranks[0], sft_plan.ranks[0]
    assert single.transient >= max(rl["generation_peak_bytes"], rl["no_grad_forward_bytes"])
    assert single.transient > base.transient
    shape = F.shape_from_config(_tiny_config())
    T, N, completions = 48, 8, 8
    lora = plan.trainable_parameters
    train = completions * T * F.flops_per_token(shape, T, lora_params=lora, logits_fraction=N / T)
    sample = completions * T * F.reference_flops_per_token(shape, T, 1 / T, 0)
    forward = forwards * completions * T * F.reference_flops_per_token(shape, T, N / T, 0)
    for key, want in (("train_flops_per_step", train), ("generation_flops_per_step", sample),
                      ("no_grad_flops_per_step", forward)):
        assert abs(rl[key] - want) <= 1e-9 * want, (key, rl[key], want)
    assert "online RL (grpo): each round samples 16 completions per rank at once" in format_plan(plan)


def _tiny_config():
    from transformers import LlamaConfig

    cfg = load_config(TINY_YAML).model
    return LlamaConfig(vocab_size=49152, hidden_size=cfg.tiny_hidden_size, intermediate_size=cfg.tiny_intermediate_size,
                       num_hidden_layers=cfg.tiny_num_layers, num_attention_heads=cfg.tiny_num_heads,
                       num_key_value_heads=cfg.tiny_num_heads, tie_word_embeddings=True)
