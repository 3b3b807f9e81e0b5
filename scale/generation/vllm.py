"""``rl.generator: vllm``: rollouts from a colocated vLLM engine (CUDA; ``pip install 'scale[vllm]'``), behind the
generator interface of :mod:`scale.generation.rollout`. Only the LoRA adapter moves to the engine each round (saved
to a directory and loaded as a new ``LoRARequest``: a few MB, never the base weights; the sync TRL and ms-swift
users ask for, trl#5975, ms-swift#9077); every completion is sampled with its own seed (:func:`completion_seed`);
the sampled tokens' log-probs are vLLM's ``processed_logprobs`` (after temperature), so ``train/logprob_mismatch``
measures the engine against the trainer.

Not run in CI (no CUDA there): ``make gpu-check`` runs it (``benchmarks/gpu_check.py``). Checked before the model
loads by :func:`scale.generation.rollout.check_generator`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from scale.generation.rollout import Rollouts, Sampling, cut_at_stop


class VllmGenerator:
    """``rl.generator: vllm``: a colocated vLLM engine on the base model, the live LoRA adapter synced each round
    (saved to a directory and loaded as a new ``LoRARequest``: only the adapter moves), seeded per request. CUDA
    only; checked by :func:`check_generator` before the first rollout.

    Args:
        sampling: the ``rl.*`` sampling settings.
        base_model: the base model's directory (what vLLM loads).
        lora_rank: ``lora.r`` (vLLM's ``max_lora_rank``).
        gpu_memory_utilization: the share of the GPU vLLM may take (``rl.vllm_gpu_memory_utilization``).
        max_model_len: the longest prompt + completion (``data.max_length``).
    """

    name = "vllm"

    def __init__(self, sampling: Sampling, base_model: str, lora_rank: int, gpu_memory_utilization: float = 0.3,
                 max_model_len: int = 2048) -> None:
        from vllm import LLM

        self.sampling = sampling
        self.llm = LLM(model=base_model, enable_lora=True, max_lora_rank=lora_rank, max_loras=1,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        self.dir = tempfile.TemporaryDirectory(prefix="scale-vllm-adapter-")
        self.version = 0

    def sync(self, model: torch.nn.Module) -> Any:
        """Save the live adapter and return the ``LoRARequest`` that loads it (a new id each round)."""
        from vllm.lora.request import LoRARequest

        self.version += 1
        path = Path(self.dir.name) / f"v{self.version}"
        model.save_pretrained(str(path))  # a PeftModel: the adapter only
        return LoRARequest(f"policy-{self.version}", self.version, str(path))

    def generate(self, model: torch.nn.Module, prompts: list[list[int]], seeds: list[int],
                 synced: bool = False) -> Rollouts:
        from vllm import SamplingParams

        s = self.sampling
        request = self.sync(model)
        params = [SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                                 max_tokens=s.max_completion_length, stop_token_ids=list(s.stop_ids), seed=int(seed),
                                 logprobs=0, detokenize=False) for seed in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request,
                                 use_tqdm=False)
        stops = set(s.stop_ids)
        completions, truncated, logps = [], [], []
        for o in outs:
            c, cut = cut_at_stop(list(o.outputs[0].token_ids), stops)
            completions.append(c)
            truncated.append(cut)
            lp = [d[t].logprob if d and t in d else float("nan")  # the sampled token's own entry
                  for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
            logps.append(torch.tensor(lp[:len(c)], dtype=torch.float32))
        return Rollouts(completions, logps, truncated, sum(len(c) for c in completions))
