"""Plain-tensor modules never import accelerate or torch.distributed (only train, checkpoint, metrics may)."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

PLAIN = ["config", "data", "loss", "modeling", "schedule", "assets", "export", "report", "flops"]


@pytest.mark.parametrize("name", PLAIN)
def test_plain_module_has_no_distributed_imports(name):
    tree = ast.parse((ROOT / "scale" / f"{name}.py").read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported |= {f"{node.module}.{a.name}" for a in node.names}
    bad = {m for m in imported if m.startswith("accelerate") or m.startswith("torch.distributed")}
    assert not bad, f"scale/{name}.py imports {bad}"


def test_loop_has_no_print_empty_cache_or_len_batch():
    src = (ROOT / "scale" / "train.py").read_text(encoding="utf-8")
    for banned in ("print(", "empty_cache(", "len(batch)", ".item()"):
        assert banned not in src, banned
