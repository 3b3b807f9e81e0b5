"""Shared fixtures: tiny configs (no model download), accelerate state reset, offline W&B."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "train" / "tiny_cpu.yaml"
TINY_DATA = ROOT / "configs" / "data" / "tiny_reviews.jsonl"
SHARED_DATA = ROOT.parent / "shared" / "data"


def tiny_cfg(out: Path, *overrides: str):
    """The tiny CPU job with its output in ``out`` and absolute data path, plus overrides."""
    from scale.config import load_config

    return load_config(TINY_YAML, [f"output_dir={out}", f"data.path={TINY_DATA}", *overrides])


@pytest.fixture(autouse=True)
def _reset_accelerate():
    """Accelerator state is process-global; reset it so each in-process run starts clean."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def tokenizer():
    from scale.config import ModelConfig
    from scale.modeling import load_tokenizer

    return load_tokenizer(ModelConfig(name_or_path="tiny-llama"))


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory):
    """The tiny job on one device (tests/launching.py's JOB: micro-batch 8, 6 steps, checkpointing, invariants
    checked): the numbers every launch mode must reproduce. Run once per session, in this process (``scale.cli.main``,
    as ``python -m scale.train`` runs it), for tests/test_distributed.py."""
    from tests.launching import CHECKED, modes, run_in_process

    _, overrides = modes()["single 1x(8,1)"]
    return run_in_process(overrides + CHECKED, tmp_path_factory.mktemp("single"))
