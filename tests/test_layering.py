"""The package's layout: which room may import which, who may touch accelerate/torch.distributed, and the three
counts of issue 28 over the whole package: no import circle, no import that runs up the layers, no import of a
scale module inside a function (the documented exceptions are listed here).

A room is a module of ``scale/`` (``config``), a stage of ``scale/data/`` (``data.read``), the format package
``scale/data/tasks/`` (``data.tasks``) or the data package's face (``data``: its ``__init__``). A new module
must be added to ``ALLOWED`` (with the rooms it may import) and to a layer of ``LAYERS``: the layout is a
decision, not an accident. Imports inside functions and under ``TYPE_CHECKING`` count too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCALE = ROOT / "scale"

# room -> the rooms it may import. Plain-tensor rooms first, then the data stages, the loop side, the entry points.
ALLOWED: dict[str, set[str]] = {
    "utils.fileio": set(),
    "utils.compat": set(),  # library APIs that moved between the declared bounds, and the tested version ranges
    "utils.logs": set(),  # the log format and third-party notice filters every command uses
    "utils.flops": set(),
    "utils.signals": set(),
    "training.state": {"config.validation"},  # TrainerState, SaveTimer (moved out of checkpoint, issue 20), a resume's global batch
    "config.validation": set(),  # the config's rules and ConfigError: the schema imports them
    "config.schema": {"config.validation"},  # Config.__post_init__ runs the rules
    "training.best": {"utils.fileio", "training.state", "config.validation"},  # train.keep_best, early stopping (issue 20)
    "config.help": {"config.names", "config.schema", "config.validation"},  # --help and docs/config.md, generated from the schema
    "config.load": {"utils.fileio", "config.names", "config.schema", "config.validation"},
    "config.names": {"config.schema"},  # TRL/transformers names -> scale keys, closest keys to a typo
    "distributed.topology": {"config.validation"},  # processes per machine: one per visible GPU (torch only where a GPU driver is)
    "utils.assets": {"utils.fileio"},
    "training.schedule": {"config.schema"},
    "utils.wrapped": set(),  # the transformers model under DDP/DeepSpeed/peft wrappers (attribute walking only)
    "loss.tail": {"utils.wrapped"},
    "loss.chunked": {"loss.tail"},  # the chunked tail loss: fp32 logits of one chunk of the tail at a time
    "objectives": {"loss.chunked", "loss.tail", "config.schema", "config.validation"},  # one file per objective; loss.objective picks one
    "modeling.build": {"utils.assets", "utils.compat", "modeling.moe", "config.schema", "config.validation"},
    "modeling.moe": {"utils.compat", "utils.flops", "config.validation"},  # mixture-of-experts models: LoRA targets, expert load, active counts
    "modeling.mixed_paths": {"utils.wrapped"},  # mixed-precision paths with fewer casts (bf16 autocast where it pays)
    "modeling.kernels": {"config.validation", "utils.wrapped"},  # model.kernels: Liger-Kernel's RMSNorm/SwiGLU/RoPE patches, by model family
    # packed rows' attention one example at a time where no varlen kernel runs
    "modeling.varlen": {"loss.tail", "modeling.mixed_paths", "utils.wrapped"},
    "modeling.attention": {"config.schema", "config.validation"},  # which attention a run may use: the kernel, packing, sequence parallelism
    # scale-plan's counts: meta/fake tensors, no process group
    "planner.census": {"config.load", "config.schema", "modeling.build", "modeling.moe"},
    "planner.activations": {"config.schema", "loss.chunked", "loss.tail", "modeling.moe", "objectives", "planner.census"},
    "planner.pairs": {"config.schema", "objectives", "planner.activations", "utils.flops"},
    "planner.moe": {"modeling.moe", "planner.census", "utils.flops"},
    "planner.layouts": {"config.load", "config.schema", "modeling.attention", "planner.activations", "planner.census"},
    # scale/data/: the stages, each importing only the ones before it (LAYERS)
    "data.read": {"config.schema"},                                   # files -> rows of cells; DataError
    "data.sources": {"utils.assets", "data.read", "utils.fileio"},         # any source -> rows
    "data.tasks": {"config.load", "data.read", "data.sources", "loss.tail", "config.schema"},  # one module per format: rows -> tokens
    "data.split": {"data.read", "config.schema"},                     # one source's train/eval rows
    "data.mixing": {"utils.assets", "data.read", "data.sources", "data.split", "data.tasks", "config.schema", "config.validation"},
    "data.tokenize": {"data.mixing", "data.read", "data.split", "data.tasks", "config.schema", "config.validation"},  # -> Splits
    "data.token_table": {"data.tasks"},                        # the cache's memory-mapped splits
    "data.cache": {"data.mixing", "data.read", "data.tasks", "data.token_table", "data.tokenize", "utils.fileio",
                   "config.validation"},
    "data.collate": {"data.tasks"},                            # padded, padding-free and packed batches
    "data.order": set(),                                       # length-grouped sampling, packing into bins
    "data.sequence": {"data.collate"},                         # sequence-parallel rows: each rank's shard (issue 29)
    "data": {"data.collate", "data.read", "data.split", "data.tasks", "data.tokenize"},  # the face: hands names on
    "generation.export": {"config.load", "config.schema", "data.tasks", "modeling.build", "modeling.moe",
                          "utils.fileio"},
    "generate": {"config.help", "generation.generator", "modeling.build", "utils.logs"},
    "generation.generator": {"config.load", "config.schema", "data.tasks", "generation.export", "modeling.build",
                             "modeling.moe"},
    # scale-lm-eval: the eval split (token cache, samples' prompt/answer split) as a harness task
    "lmeval": {"utils.assets", "config.load", "config.help", "data", "data.cache", "data.read", "data.tasks", "generation.export", "utils.fileio",
               "utils.logs", "modeling.build", "training.samples"},
    "planner.plan": {"config.schema", "data.tokenize", "modeling.build", "planner.activations", "planner.census", "planner.layouts", "planner.moe", "planner.pairs", "utils.assets"},
    "plan": {"config.help", "config.load", "config.schema", "config.validation", "planner.autobatch", "planner.census", "planner.layouts", "planner.plan", "training.state", "utils.logs"},
    # state: --resume reads a checkpoint's trainer_state.json
    # the loop side: may import accelerate / torch.distributed
    "distributed.rendezvous": set(),
    "distributed.launch": {"config.load", "distributed.inputs", "distributed.rendezvous", "config.schema", "distributed.topology", "config.validation"},
    # paths, output_dir, GPU-only kernels, trackers: checked before any process group
    "distributed.inputs": {"config.schema", "config.validation"},
    "planner.autobatch": {"config.schema", "config.validation", "planner.census", "planner.layouts", "planner.plan"},
    "distributed.collective": set(),  # on_every_rank, main_process_first, shared_run_id
    "training.startup": {"training.checks", "utils.compat", "data.token_table", "data.tokenize", "distributed.launch", "config.names", "training.parts", "training.precision",
                "training.schedule", "config.schema"},  # the start-up lines
    # scale/training/parts/: each part of a run builds itself (launch, data, model, loaders, ...)
    "training.parts": {"utils.assets", "modeling.attention", "planner", "training.best", "training.checkpoint", "distributed.collective", "data.cache", "data.collate",
              "data.mixing", "data.order", "data.read", "data.sequence", "data.tasks", "data.token_table", "data.tokenize",
              "training.evaluate", "generation.export", "utils.flops", "modeling.kernels", "distributed.launch", "training.metrics", "modeling.mixed_paths", "modeling.build", "modeling.moe",
              "objectives", "training.precision", "training.samples", "training.schedule", "config.schema", "training.state", "training.tracking", "distributed.ulysses", "config.validation",
              "modeling.varlen"},
    "training.windows": {"loss.tail", "objectives", "utils.signals", "training.state"},  # accumulation windows: one all-gather per optimizer step
    "distributed.ulysses": {"data.sequence"},  # the sequence-parallel attention, loaders and eval forward (DeepSpeed Ulysses)
    "training.metrics": {"utils.fileio", "utils.flops", "config.schema"},
    "training.precision": {"utils.fileio", "utils.flops", "config.schema"},  # train.mixed_precision=auto, the GEMM probe, one device's peak FLOP/s
    "training.tracking": {"config.load", "utils.fileio", "training.metrics", "config.schema"},
    "training.checks": {"modeling.build"},
    # the package scale/training/checkpoint/: store, resume rules, save/load, the portable state any launch mode loads
    "training.checkpoint": {"config.load", "utils.fileio", "distributed.launch", "modeling.build", "config.schema", "training.state", "config.validation"},
    "training.evaluate": {"data.tasks", "loss.tail", "objectives", "utils.signals"},
    "training.samples": {"training.checkpoint", "utils.signals", "training.tracking"},  # generation at each evaluation (issue 20)
    "training.job": {"training.checkpoint", "config.load", "data.tasks", "distributed.launch", "training.metrics", "modeling.build", "objectives", "training.parts", "training.precision",
            "training.samples", "config.schema", "training.startup", "training.state", "distributed.ulysses"},
    "training.commit": {"training.job", "training.metrics", "training.windows"},  # when a trained window's optimizer step is applied (StepCommit)
    "train": {"training.best", "training.checkpoint", "training.checks", "training.commit", "training.evaluate", "generation.export", "training.job", "training.metrics", "training.samples", "config.schema",
              "utils.signals", "training.state", "training.tracking", "distributed.ulysses", "training.windows"},
    "cli": {"utils.assets", "training.checkpoint", "training.commit", "config.load", "config.help", "data.mixing", "data.read", "data.tokenize",
            "distributed.inputs",
            "distributed.launch", "distributed.launcher", "utils.logs", "modeling.build", "config.schema", "utils.signals", "train", "config.validation"},
    "distributed.launcher": {"config.load", "distributed.topology"},  # scale-train --accelerate-config
    "report": {"config.load", "config.help", "training.metrics", "training.schedule", "config.validation"},
    "prepare": {"utils.assets", "config.load", "config.help", "data.cache", "data.read", "data.token_table", "utils.logs", "modeling.build",
                "config.validation"},  # scale-prepare
    "env": {"utils.compat"},  # scale-env: versions, devices, CPU flags and launcher variables for a bug report
    "utils": set(),  # the wing's face
    "generation": set(),  # the wing's face
    "export": {"config.help", "config.load", "generation.export", "modeling.build", "utils.logs"},  # scale-export
    "config": {"config.load"},  # the wing's face: hands config.load's names on
    "loss": {"loss.tail"},  # the wing's face: hands loss.tail's names on
    "modeling": {"modeling.build"},  # the wing's face: hands modeling.build's names on
    "planner": {"planner.autobatch"},  # the wing's face: the run's one door (plan_micro_batch)
    "distributed": set(),  # the wing's face
    "training": set(),  # the wing's face
    "assets": {"utils.assets"},  # kept for scripts outside the package
    "job": {"training.job"},  # kept for scripts outside the package
}
DISTRIBUTED = {"distributed.launch", "distributed.rendezvous", "training.metrics", "training.tracking", "training.checks", "training.checkpoint", "training.evaluate", "training.job", "train", "cli",
               "training.samples", "training.precision", "distributed.ulysses", "distributed.collective", "training.startup", "training.parts", "training.windows", "distributed.inputs", "training.commit"}

# Bottom first. A room imports rooms of its own layer or below; an import into a higher layer runs upward. The data
# stages are one layer each, in the order rows flow: files, sources, formats, split, mixing, tokens, cache, batches.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"utils.compat", "utils.fileio", "utils.flops", "utils.logs", "utils.signals", "training.state", "distributed.rendezvous", "config.validation", "config.schema",
                     "utils.wrapped",
                     "config.names", "config.load", "config.help", "utils.assets", "training.schedule", "distributed.topology",
                     "distributed.launcher"}),
    ("model and loss (plain tensors)", {"loss.tail", "loss.chunked", "objectives", "modeling.moe", "modeling.build", "modeling.mixed_paths",
                                        "modeling.kernels", "modeling.attention", "planner.census", "planner.layouts", "modeling.varlen",
                                        "planner.activations", "planner.pairs", "planner.moe"}),
    ("data: reading files", {"data.read"}),
    ("data: sources", {"data.sources"}),
    ("data: tasks, one module per format", {"data.tasks"}),
    ("data: split", {"data.split"}),
    ("data: mixing", {"data.mixing"}),
    ("data: tokenization", {"data.tokenize"}),
    ("data: cache", {"data.token_table", "data.cache"}),
    ("data: collation and order", {"data.collate", "data.order", "data.sequence"}),
    ("data: the package's face", {"data"}),
    ("the memory plan (scale-plan; the start-up plans train.micro_batch_size=auto)", {"planner.plan", "planner.autobatch", "planner"}),
    ("the loop side", {
                       "distributed.inputs", "distributed.collective", "training.metrics", "training.precision", "training.tracking", "distributed.launch", "distributed.ulysses", "training.checks",
                       "training.checkpoint", "training.best", "training.evaluate", "training.samples", "generation.export", "generation.generator", "generate", "training.parts", "training.startup", "training.windows",
                       "training.job", "training.commit", "train"}),
    ("entry points", {"cli", "env", "prepare", "report", "lmeval", "export", "plan"}),
    ("the wings' faces and the re-export modules: nothing inside imports them", {"utils", "config", "loss", "modeling", "distributed", "training", "generation", "assets", "job"}),
]
# Imports of scale modules inside a function, each deferring a heavy library: `scale-train --help` and
# `--accelerate-config` import neither torch nor accelerate (scale/cli.py's module comment), and start_fast imports
# the loop with the garbage collector paused. Nothing else may import inside a function.
DEFERRED = {("cli", "training.checkpoint"), ("cli", "training.commit"), ("cli", "data.mixing"), ("cli", "data.read"), ("cli", "data.tokenize"),
            ("cli", "distributed.inputs"), ("cli", "distributed.launch"), ("cli", "modeling.build"), ("cli", "train")}

# Packages that are one room each (their modules are read as one): the formats, the objectives, the checkpoint, the
# parts of a run. Every other module is a room of its own, named by its dotted path under scale/.
PACKAGE_ROOMS = ("data.tasks", "objectives", "training.checkpoint", "training.parts")
# The loop's modules: no print, no empty_cache, no len(batch), no host read (.item()).
LOOP = ("train", "training.commit", "training.windows", "training.evaluate", "loss.tail", "training.metrics")


def _room(module: str) -> str | None:
    """The room of a dotted module name, or of a name a module defines (``scale.data.tasks.base`` -> ``data.tasks``,
    ``scale.data.read.DataError`` -> ``data.read``); None outside ``scale``."""
    parts = (_resolve(module, _modules()) or "").split(".")
    if parts[0] != "scale" or len(parts) == 1:
        return None
    name = ".".join(parts[1:])
    return next((p for p in PACKAGE_ROOMS if name == p or name.startswith(p + ".")), name)


@functools.cache
def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(SCALE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` (a module, or a module's attribute) as the module it names."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _file_imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported name, inside a function)`` of every import of ``path`` (``from m import a`` as ``m.a``: the module
    ``m.a`` where ``a`` is a submodule, else a name of ``m``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn) if n is not fn}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in inside) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:  # `from m import a` imports m.a, or m where a is a name
            found += [(f"{node.module}.{a.name}", id(node) in inside) for a in node.names]
    return found


def _links() -> list[tuple[str, str, bool]]:
    """``(module, scale module it imports, inside a function)`` over the whole package."""
    modules = _modules()
    out = set()
    for name, path in modules.items():
        for imported, local in _file_imports(path):
            target = _resolve(imported, modules) if imported.startswith("scale.") or imported == "scale" else None
            if target not in (None, "scale", name):
                out.add((name, target, local))
    return sorted(out)


def _imports(room: str) -> set[str]:
    """Every name the files of ``room`` import."""
    return {imported for name, path in _modules().items() if _room(name) == room for imported, _ in _file_imports(path)}


def test_every_module_is_in_the_table():
    rooms = {_room(name) for name in _modules()} - {None}
    assert rooms == set(ALLOWED), f"add to / remove from ALLOWED: {rooms ^ set(ALLOWED)}"
    layered = [room for _, rooms_ in LAYERS for room in rooms_]
    assert sorted(layered) == sorted(set(ALLOWED)), f"give each room one layer: {set(layered) ^ set(ALLOWED)}"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_module_imports_only_what_the_table_allows(room):
    imported = _imports(room)
    ours = {_room(m) for m in imported if m.startswith("scale.")} - {room, None}
    assert ours <= ALLOWED[room], f"{room} imports {sorted(ours - ALLOWED[room])}, not in its row"
    distributed = {m for m in imported if m.startswith(("accelerate", "torch.distributed", "deepspeed"))}
    if room not in DISTRIBUTED:
        assert not distributed, f"{room} is plain-tensor code but imports {sorted(distributed)}"


def test_no_import_circle():
    """Tarjan's strongly connected components of the module graph (every import, at any depth): none has more than
    one module."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in _links():
        graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_no_import_runs_upward():
    """Every import stays in its layer or goes down (the package's own ``scale/__init__.py``, above every layer,
    imports scale.utils.signals to exit at once on a signal while the libraries load)."""
    layer = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}
    upward = [f"{a} -> {b}" for a, b, _ in _links() if a != "scale" and layer[_room(b)] > layer[_room(a)]]
    assert upward == []


def test_no_scale_import_inside_a_function_but_the_deferred():
    local = {(_room(a), _room(b)) for a, b, inside in _links() if inside}
    assert local == DEFERRED, f"imports inside functions: {sorted(local - DEFERRED)}; no longer: {DEFERRED - local}"
    cli = (SCALE / "cli.py").read_text(encoding="utf-8").splitlines()
    for line in cli:  # each deferral says why
        if line.startswith("    ") and line.lstrip().startswith(("from scale", "import scale")):
            assert "deferred" in line, line


def test_loop_has_no_print_empty_cache_or_len_batch():
    modules = _modules()
    for name in LOOP:
        src = modules[f"scale.{name}"].read_text(encoding="utf-8")
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
    """Issue 17: outside scale/data/tasks/ only the registry (scale/data/tasks/__init__.py) and the schema and its
    rules (data.format's choices) name the formats; the other data stages, evaluate.py, loss.py, job.py... ask the
    format's module instead."""
    offenders = {}
    rules = {_modules()[m] for m in ("scale.config.schema", "scale.config.validation")}
    for path in sorted((ROOT / "scale").rglob("*.py")):
        rel = path.relative_to(ROOT / "scale").as_posix()
        if rel.startswith("data/tasks/") and rel != "data/tasks/__init__.py" or path in rules:
            continue
        if rel == "data/tasks/__init__.py":  # the registry: names each format once, in its table
            continue
        hits = _format_names_in_code(path)
        if hits:
            offenders[rel] = hits
    assert offenders == {}, f"format names outside scale/data/tasks/: {offenders}"
