"""Generators: what samples a round's completions with the live policy (``rl.generator``). Plain torch.

One interface (:class:`Generator`), two implementations:

- ``transformers`` (:class:`TransformersGenerator`, any device): in-process ``model.generate`` with the KV cache,
  the prompts of one rank in one call. Sampling is seeded per completion, not per batch or rank: a logits
  processor (:class:`SeededSampler`) adds Gumbel noise drawn from the completion's own generator (seeded by
  :func:`completion_seed` from ``train.seed``, the round, the prompt's index in the split and the completion's index
  in its group) to the tempered, top-k/top-p filtered logits, and ``generate`` takes the argmax: an exact sample of
  the filtered softmax (the Gumbel-max trick, Gumbel 1954; Maddison et al. 2014, arXiv:1411.0030, sec. 2), the same
  completion whatever else shares the batch, the rank or the launch mode (up to round-off in the logits). The same
  processor records each sampled token's log-probability under ``softmax(logits / temperature)``: the sampler's
  log-probs (``train/logprob_mismatch``).
- ``vllm`` (:class:`scale.generation.vllm.VllmGenerator`, CUDA and ``pip install scale[vllm]``): a colocated vLLM
  engine on the base model; each round syncs only the LoRA adapter (saved, then loaded as a new ``LoRARequest``),
  never the base weights; per-request seeds. Refused in one line where it cannot run (:func:`check_generator`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

GENERATORS = ("transformers", "vllm")
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def completion_seed(seed: int, round_index: int, prompt_index: int, generation: int) -> int:
    """The seed of one completion: a hash of ``train.seed``, the round (its first optimizer step), the prompt's
    index in the train split and the completion's index in its group; < 2**63 (``torch.Generator.manual_seed``)."""
    h = 0
    for part in (seed, round_index, prompt_index, generation):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


@dataclass
class Sampling:
    """How completions are sampled (``rl.*``).

    Attributes:
        temperature: > 0; the logits are divided by it. 0: greedy (the evaluation's completions; no log-probs).
        top_p: nucleus mass in (0, 1]; 1 = off.
        top_k: keep the ``top_k`` most likely tokens; 0 = off.
        max_completion_length: the most tokens a completion gets, its stop token included.
        stop_ids: token ids a completion ends at (kept as its last token): EOS, the template's end-of-turn,
            ``rl.stop``.
        pad_id: the padding token id.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 256
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0


@dataclass
class Rollouts:
    """What a generator returns for ``C`` prompts (one row per completion, in the order asked).

    Attributes:
        completion_ids: each completion's tokens, through its stop token when it has one.
        sampler_logps: ``[len(completion)]`` float32 each: the sampler's log-prob of each token (under
            ``softmax(logits / temperature)``), or ``None`` when the generator gives none.
        truncated: the completion hit ``max_completion_length`` without a stop token.
        tokens: tokens generated (prompts excluded), for ``train/rollout_tokens_per_s``.
    """

    completion_ids: list[list[int]]
    sampler_logps: list[Tensor] | None
    truncated: list[bool]
    tokens: int = 0


class Generator(Protocol):
    """Samples completions of token prompts with the live policy."""

    name: str

    def generate(self, model: torch.nn.Module, prompts: list[list[int]], seeds: list[int],
                 synced: bool = False) -> Rollouts:
        """One completion per entry of ``prompts`` (token ids, no padding), seeded by ``seeds`` (one each).

        Args:
            model: the policy as it is now (unwrapped: a ``PeftModel`` or a transformers model).
            prompts: ``C`` prompts (a prompt of ``G`` completions appears ``G`` times).
            seeds: ``C`` seeds (:func:`completion_seed`).
            synced: the weights are partitioned over ranks (ZeRO-3, FSDP): keep every rank's forwards in step.
        """
        ...


def cut_at_stop(ids: list[int], stops: set[int]) -> tuple[list[int], bool]:
    """``(completion, truncated)``: ``ids`` through its first stop token, or all of them (truncated) when none."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i + 1], False
    return ids, True


class SeededSampler:
    """A logits processor that samples each row from its own generator (Gumbel-max) and records the sampled
    token's log-prob; ``generate`` then runs greedy (``do_sample=False``), so its argmax is this sample.

    Per step: ``z = scores / temperature`` (float32); ``logp = log_softmax(z)``; ``z`` filtered by top-k, then
    top-p (transformers' own warpers, as ``do_sample`` would apply them); ``z - log(E)`` with ``E ~ Exp(1)`` i.i.d.
    per vocabulary entry from the row's generator (``-log E`` is a standard Gumbel); the argmax of that is returned
    as the only finite score, and ``logp`` at it is recorded.

    Args:
        seeds: one per row.
        sampling: temperature, top-k, top-p.
        device: where the generators draw.
    """

    def __init__(self, seeds: list[int], sampling: Sampling, device: torch.device) -> None:
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.temperature = sampling.temperature
        self.warpers = ([TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else []) + \
                       ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1.0 else [])
        self.logps: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        z = scores.float() / self.temperature
        logp = torch.log_softmax(z, dim=-1)
        for warp in self.warpers:
            z = warp(input_ids, z)
        V = z.shape[-1]
        noise = torch.stack([torch.empty(V, device=z.device).exponential_(generator=g) for g in self.generators])
        token = (z - noise.log()).argmax(-1)
        self.logps.append(logp.gather(-1, token[:, None]).squeeze(-1))
        out = torch.full_like(z, -torch.inf)
        return out.scatter_(-1, token[:, None], 0.0)


class TransformersGenerator:
    """``rl.generator: transformers``: ``model.generate`` in-process, seeded per completion (module docstring).

    Args:
        sampling: the ``rl.*`` sampling settings.
    """

    name = "transformers"

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, prompts: list[list[int]], seeds: list[int],
                 synced: bool = False) -> Rollouts:
        from transformers import GenerationConfig, LogitsProcessorList

        s = self.sampling
        device = next(model.parameters()).device
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), s.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, P - len(p):] = 1
        sampler = SeededSampler(seeds, s, device) if s.temperature > 0 else None
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=s.max_completion_length,
                                  min_new_tokens=0, eos_token_id=list(s.stop_ids), pad_token_id=s.pad_id,
                                  use_cache=True)
        was_training = model.training
        model.eval()
        try:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                                 logits_processor=LogitsProcessorList([sampler] if sampler else []),
                                 synced_gpus=synced)
        finally:
            model.train(was_training)
        new = out[:, P:].tolist()  # host sync (once per round)
        logps = (torch.stack(sampler.logps, 1).float().cpu() if sampler.logps else torch.zeros(len(prompts), 0)) \
            if sampler is not None else None
        stops = set(s.stop_ids)
        completions, truncated, sampler_logps = [], [], []
        for b, row in enumerate(new):
            c, cut = cut_at_stop(row, stops)
            completions.append(c)
            truncated.append(cut)
            if logps is not None:
                sampler_logps.append(logps[b, :len(c)].clone())
        return Rollouts(completions, sampler_logps if logps is not None else None, truncated,
                        sum(len(c) for c in completions))


def check_generator(name: str, cuda: bool) -> None:
    """Refuse a generator that cannot run here, in one line (before the model loads).

    Raises:
        ValueError: an unknown ``rl.generator``; ``vllm`` without CUDA or without the package.
    """
    if name not in GENERATORS:
        raise ValueError(f"rl.generator={name!r} is not one of {list(GENERATORS)}")
    if name == "vllm":
        if not cuda:
            raise ValueError("rl.generator=vllm needs a CUDA device and this run has none; set "
                             "rl.generator=transformers (in-process generate, any device)")
        if importlib.util.find_spec("vllm") is None:
            raise ValueError("rl.generator=vllm needs the vllm package: pip install 'scale[vllm]' (or set "
                             "rl.generator=transformers)")
