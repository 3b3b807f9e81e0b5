"""The package's import table: which room may import which, and who may touch accelerate/torch.distributed.

A new module must be added to ``ALLOWED`` (with the rooms it may import): the layout is a decision, not an
accident. Imports inside functions count too.
"""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

# module -> the scale modules it may import. Plain-tensor rooms first, then the loop side, then entry points.
ALLOWED: dict[str, set[str]] = {
    "fileio": set(),
    "flops": set(),
    "signals": set(),
    "schema": set(),
    "config": {"fileio", "schema"},
    "assets": {"fileio"},
    "schedule": {"config"},
    "sources": {"assets", "fileio", "formats"},  # formats/assets imported inside functions (issue 18)
    "formats": {"config", "sources"},
    "data": {"config", "formats", "sources"},
    "cache": {"data", "fileio", "sources"},  # the token cache (issue 18): numpy/pyarrow, no process group
    "loss": {"config"},
    "modeling": {"config", "assets"},
    "sampling": {"data"},
    "export": {"config", "fileio", "modeling"},
    "census": {"config", "loss", "modeling"},  # scale-plan's counts: meta/fake tensors only, no process group
    "layouts": {"census", "config"},
    "plan": {"census", "config", "layouts"},
    # the loop side: may import accelerate / torch.distributed
    "launch": {"config"},
    "metrics": {"config", "fileio", "flops"},
    "checks": {"modeling"},
    "checkpoint": {"config", "fileio", "launch", "modeling"},
    "evaluate": {"data", "loss"},
    "job": {"assets", "cache", "checkpoint", "checks", "config", "data", "fileio", "flops", "launch", "loss",
            "metrics", "modeling", "sampling", "schedule", "sources"},
    "train": {"checkpoint", "checks", "config", "evaluate", "job", "loss", "metrics", "signals"},
    "cli": {"checkpoint", "config", "data", "launch", "signals", "train"},
    "report": {"config", "metrics", "schedule"},
    "prepare": {"assets", "cache", "config", "data", "modeling"},  # scale-prepare (issue 18)
}
DISTRIBUTED = {"launch", "metrics", "checks", "checkpoint", "evaluate", "job", "train", "cli"}


def _imports(name: str) -> set[str]:
    tree = ast.parse((ROOT / "scale" / f"{name}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "scale":
                found |= {f"scale.{a.name}" for a in node.names}
    return found


def test_every_module_is_in_the_table():
    modules = {p.stem for p in (ROOT / "scale").glob("*.py") if p.stem != "__init__"}
    assert modules == set(ALLOWED), f"add to / remove from ALLOWED: {modules ^ set(ALLOWED)}"


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_module_imports_only_what_the_table_allows(name):
    imported = _imports(name)
    ours = {m.split(".")[1] for m in imported if m.startswith("scale.")}
    assert ours <= ALLOWED[name], f"scale/{name}.py imports {sorted(ours - ALLOWED[name])}, not in its row"
    distributed = {m for m in imported if m.startswith(("accelerate", "torch.distributed", "deepspeed"))}
    if name not in DISTRIBUTED:
        assert not distributed, f"scale/{name}.py is plain-tensor code but imports {sorted(distributed)}"


def test_loop_has_no_print_empty_cache_or_len_batch():
    for name in ("train", "evaluate", "loss", "metrics"):
        src = (ROOT / "scale" / f"{name}.py").read_text(encoding="utf-8")
        for banned in ("print(", "empty_cache(", "len(batch)", ".item()"):
            assert banned not in src, (name, banned)
