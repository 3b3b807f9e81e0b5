"""Reward functions the GRPO tests and the parity rows train with (TRL's signature), importable by path from every
launched process (``tests.rl_rewards:first_token_parity``)."""

from __future__ import annotations

from typing import Any


def first_token_parity(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """1 when a completion's first token id is odd: a reward the tiny random model's completions vary in, so every
    group has a spread (an exact-answer reward alone would be 0 everywhere and train nothing)."""
    return [float(ids[0] % 2) for ids in completion_ids]
