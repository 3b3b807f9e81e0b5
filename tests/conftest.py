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
    from scale.config.load import load_config

    return load_config(TINY_YAML, [f"output_dir={out}", f"data.path={TINY_DATA}", *overrides])


def log_file_lines(records) -> list[str]:
    """Log records as the CLI writes them to a log file (:data:`scale.utils.logs.LOG_FORMAT`), one entry per line: what
    docs/outputs.md keeps under 300 characters."""
    import copy
    import logging

    from scale.utils.logs import LOG_FORMAT, _Notices

    fmt, notices = logging.Formatter(LOG_FORMAT), _Notices()  # the CLI's handlers rewrite the known notices
    lines = []
    for r in records:
        r = copy.copy(r)
        notices.filter(r)
        lines += fmt.format(r).splitlines()
    return lines


def reset_accelerate() -> None:
    """Reset accelerate's process-global state (``AcceleratorState``, ``GradientState``), so the next in-process run
    starts clean; a module-scoped fixture that trains calls it after its run."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _reset_accelerate():
    """Accelerator state is process-global; reset it so each in-process run starts clean."""
    yield
    reset_accelerate()


@pytest.fixture(scope="session")
def tokenizer():
    from scale.config.schema import ModelConfig
    from scale.modeling.build import load_tokenizer

    return load_tokenizer(ModelConfig(name_or_path="tiny-llama"))


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory):
    """The tiny job on one device (tests/launching.py's JOB: micro-batch 8, 6 steps, checkpointing, invariants
    checked): the numbers every launch mode must reproduce. Run once per session, in this process (``scale.cli.main``,
    as ``python -m scale.train`` runs it), for tests/test_distributed.py."""
    from tests.launching import CHECKED, modes, run_in_process

    _, overrides = modes()["single 1x(8,1)"]
    return run_in_process(overrides + CHECKED, tmp_path_factory.mktemp("single"))


CHAT_SYSTEM = "You keep a list of items."


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory):
    """A tiny ChatML chat run that learnt its answers, exported: ``(run dir, merged dir, data rows)``. 48 chats of a
    system turn and two user turns ("Add item i to the list." -> "Added.", "And item i+1?" -> "Added that one
    too."), 8 held out; 30 steps at lr 1e-2; the final evaluation generates every held-out answer into
    ``samples.jsonl``. Trained once per session for the serving and lm-eval tests (~20 s)."""
    import json

    from scale.generation.export import merge_run
    from scale.train import run

    tmp = tmp_path_factory.mktemp("chat_run")
    rows = [{"messages": [{"role": "system", "content": CHAT_SYSTEM},
                          {"role": "user", "content": f"Add item {i} to the list."},
                          {"role": "assistant", "content": "Added."},
                          {"role": "user", "content": f"And item {i + 1}?"},
                          {"role": "assistant", "content": "Added that one too."}]} for i in range(48)]
    (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / "run"
    run(tiny_cfg(out, f"data.path={tmp / 'chats.jsonl'}", "data.format=messages",
                 f"data.chat_template={ROOT / 'configs' / 'chat' / 'chatml.jinja'}", "data.eval_size=8",
                 "train.max_steps=30", "optim.lr=1e-2", "optim.schedule=constant", "optim.warmup_steps=0",
                 "train.micro_batch_size=8", "train.gradient_accumulation_steps=1", "train.eval_every=0",
                 "train.log_every=10", "log.peak_flops=false", "eval.generate_samples=8"))
    return out, merge_run(out), rows
