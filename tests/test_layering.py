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
    "state": {"config"},  # TrainerState, SaveTimer (moved out of checkpoint, issue 20), the global batch of a resume
    "best": {"config", "fileio", "state", "validation"},  # train.keep_best, early stopping (issue 20)
    "schema": {"validation"},  # Config.__post_init__ runs the rules (imported there: validation imports schema)
    "validation": {"schema"},  # the config's rules (schema.py was over 450 lines)
    "config": {"fileio", "schema"},
    "assets": {"fileio"},
    "schedule": {"config"},
    "sources": {"assets", "fileio", "formats", "mixing"},  # formats/assets/mixing imported inside functions (issue 18)
    "formats": {"config", "tasks"},  # tasks: the names that moved there, imported lazily (PEP 562)
    "tasks": {"config", "formats", "loss", "sources", "tasks"},  # scale/tasks/: one module per data format
    "data": {"config", "formats", "mixing", "sources", "tasks"},
    # several data sets mixed by weight (issue 18); data/sources imported inside functions
    "mixing": {"assets", "config", "data", "formats", "sources", "tasks", "validation"},
    "token_table": {"tasks"},  # the cache's memory-mapped splits (issue 18)
    "cache": {"data", "fileio", "sources", "tasks", "token_table"},  # the token cache (issue 18): numpy/pyarrow, no process group
    "loss": {"config", "chunked"},  # loss_step picks the chunked loss (imported lazily: chunked imports loss)
    "chunked": {"loss"},
    "modeling": {"config", "assets"},
    "sampling": {"data"},
    "export": {"config", "data", "fileio", "modeling"},
    "generate": {"config", "export", "modeling"},
    "census": {"config", "loss", "modeling", "chunked"},  # scale-plan's counts: meta/fake tensors only, no process group
    "layouts": {"census", "config"},
    "plan": {"census", "config", "layouts", "assets", "data", "modeling", "state"},  # data: the tails; state: --resume
    # the loop side: may import accelerate / torch.distributed
    "rendezvous": set(),
    "launch": {"config", "rendezvous"},
    "metrics": {"config", "fileio", "flops"},
    "tracking": {"config", "fileio", "metrics"},
    "checks": {"modeling"},
    "portable": {"launch"},  # the mode-independent checkpoint state: any launch mode loads it (issue 30)
    "checkpoint": {"config", "fileio", "launch", "modeling", "portable", "state"},
    "evaluate": {"loss", "signals", "tasks"},
    "samples": {"checkpoint", "signals", "tracking"},  # generation at each evaluation (issue 20)
    "job": {"assets", "cache", "checkpoint", "checks", "config", "data", "fileio", "flops", "launch", "loss",
            "metrics", "mixing", "modeling", "sampling", "samples", "schedule", "sources", "tracking", "export"},
    "train": {"best", "checkpoint", "checks", "config", "evaluate", "export", "job", "loss", "metrics",
              "samples", "signals", "tracking"},
    "cli": {"assets", "checkpoint", "config", "data", "launch", "modeling", "signals", "train"},
    "report": {"config", "metrics", "schedule"},
    "prepare": {"assets", "cache", "config", "data", "modeling"},  # scale-prepare (issue 18)
}
DISTRIBUTED = {"launch", "rendezvous", "metrics", "tracking", "checks", "checkpoint", "evaluate", "job", "train", "cli",
               "samples", "portable"}


def _sources(name: str) -> list:
    """The files of a room: ``scale/<name>.py``, or every file of the package ``scale/<name>/``."""
    package = ROOT / "scale" / name
    return sorted(package.glob("*.py")) if package.is_dir() else [ROOT / "scale" / f"{name}.py"]


def _imports(name: str) -> set[str]:
    found = set()
    for path in _sources(name):
        found |= _file_imports(path)
    return found


def _file_imports(path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
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
    modules |= {p.name for p in (ROOT / "scale").iterdir() if (p / "__init__.py").is_file()}
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


FORMAT_NAMES = ("text", "classification", "prompt_completion", "messages")


def _format_names_in_code(path) -> list[str]:
    """Format names used as values in ``path``'s code: the unambiguous names anywhere as a string constant, and
    ``text``/``messages`` (also column names) where compared or looked up (``fmt == "text"``, ``get("text")``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in ("classification", "prompt_completion"):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                if isinstance(c, ast.Constant) and c.value in FORMAT_NAMES:
                    found.append(f"line {node.lineno}: compares with {c.value!r}")
                elif isinstance(c, (ast.Tuple, ast.List, ast.Set)) and any(
                        isinstance(e, ast.Constant) and e.value in FORMAT_NAMES for e in c.elts):
                    found.append(f"line {node.lineno}: compares with a tuple of format names")
    return found


def test_format_names_live_in_scale_tasks_only():
    """Issue 17: outside scale/tasks/ only the registry (scale/tasks/__init__.py) and the schema and its rules (data.format's
    choices) name the formats; data.py, evaluate.py, loss.py, job.py... ask the format's module instead."""
    offenders = {}
    for path in sorted((ROOT / "scale").rglob("*.py")):
        rel = path.relative_to(ROOT / "scale").as_posix()
        if rel.startswith("tasks/") and rel != "tasks/__init__.py" or rel in ("schema.py", "validation.py"):
            continue
        if rel == "tasks/__init__.py":  # the registry: names each format once, in its table
            continue
        hits = _format_names_in_code(path)
        if hits:
            offenders[rel] = hits
    assert offenders == {}, f"format names outside scale/tasks/: {offenders}"
