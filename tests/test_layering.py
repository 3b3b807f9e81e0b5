"""The package's layout: its wings (the subpackages of ``scale/``), which wing may import which, which room may import
which, who may touch accelerate/torch.distributed, and three counts over the whole package: no import circle, no import
that runs up the layers, no import of a scale module inside a function (the documented exceptions are listed here).

A wing is a subpackage of ``scale/`` (``scale/planner/``) or the package root (``root``: the loop ``train``, ``cli`` and
the other commands). A room is a module named by its dotted path under ``scale/`` (``planner.census``), a package read
as one room (:data:`PACKAGE_ROOMS`: ``data.tasks``, ``objectives``, ...) or a package's face (its ``__init__``:
``planner``). A new module must be added to ``ALLOWED`` (with the rooms it may import) and to a layer of its wing in
``LAYERS``: the layout is a decision, not an accident. Imports inside functions and under ``TYPE_CHECKING`` count too.
docs/architecture.md draws the same map for a reader.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCALE = ROOT / "scale"

# The wings, bottom first: wing -> the wings it may import (only wings listed before it). Each wing's face says the
# same in its last paragraph ("Imports ..."), checked below.
WINGS: dict[str, tuple[str, ...]] = {
    "utils": (),  # files, logs, signals, library versions, FLOPs, the embedded assets, the wrapped model
    "config": ("utils",),  # the schema, its rules, YAML and overrides, --help
    "loss": ("utils", "config"),  # tail cross-entropy on plain tensors
    "data": ("utils", "config", "loss"),  # rows -> tokens -> batches, one stage per module
    "modeling": ("utils", "config", "loss"),  # the model: base, LoRA, MoE, attention, kernels
    "objectives": ("utils", "config", "loss", "data", "modeling"),  # what a run minimises, one file per objective
    "planner": ("utils", "config", "loss", "data", "modeling", "objectives"),  # bytes per rank, from configs
    "distributed": ("utils", "config", "loss", "data", "modeling"),  # processes, the Accelerator, collectives
    "generation": ("utils", "config", "loss", "data", "modeling", "objectives"),  # serving files, generate
    "training": ("utils", "config", "loss", "data", "modeling", "objectives", "planner", "distributed", "generation"),
    "root": ("utils", "config", "loss", "data", "modeling", "objectives", "planner", "distributed", "generation",
             "training"),  # the loop (train), the commands
}
# Wings of plain-tensor code: never accelerate, torch.distributed or deepspeed.
PLAIN = ("utils", "config", "loss", "data", "modeling", "objectives", "planner", "generation")
# Faces that hand a wing's names on to scripts outside the package (`from scale.config import load_config`), and the
# root modules kept for them: nothing inside the package imports these.
FOR_OUTSIDE = ("utils", "config", "loss", "modeling", "distributed", "generation", "training", "assets", "job")

# room -> the rooms it may import.
ALLOWED: dict[str, set[str]] = {
    # utils
    "utils.fileio": set(),  # atomic writes, file hashes
    "utils.compat": set(),  # library APIs that moved between the declared bounds, and the tested version ranges
    "utils.logs": set(),  # the log format and third-party notice filters every command uses
    "utils.flops": set(),
    "utils.signals": set(),
    "utils.assets": {"utils.fileio"},
    "utils.wrapped": set(),  # the transformers model under DDP/DeepSpeed/peft wrappers (attribute walking only)
    "utils": set(),  # the face: hands nothing on
    # config
    "config.validation": set(),  # the config's rules and ConfigError: the schema imports them
    "config.sections": set(),  # the data, loss and rl sections of the schema
    "config.schema": {"config.sections", "config.validation"},  # Config.__post_init__ runs the rules
    "config.names": {"config.schema"},  # TRL/transformers names -> scale keys, closest keys to a typo
    "config.load": {"config.names", "config.schema", "config.validation", "utils.fileio"},
    "config.help": {"config.names", "config.schema", "config.validation"},  # --help and docs/config.md
    "config": {"config.load"},  # the face: hands config.load's names on
    # loss
    "loss.tail": {"utils.wrapped"},
    "loss.chunked": {"loss.tail"},  # the chunked tail loss: fp32 logits of one chunk of the tail at a time
    "loss": {"loss.tail"},  # the face: hands loss.tail's names on
    # data: the stages, each importing only the ones before it (LAYERS)
    "data.read": {"config.schema"},  # files -> rows of cells; DataError
    "data.sources": {"data.read", "utils.assets", "utils.fileio"},  # any source -> rows
    "data.tasks": {"config.load", "config.schema", "data.read", "data.sources", "loss.tail"},  # one module per format
    "data.split": {"config.schema", "data.read"},  # one source's train/eval rows
    "data.mixing": {"config.schema", "config.validation", "data.read", "data.sources", "data.split", "data.tasks",
                    "utils.assets"},
    "data.tokenize": {"config.schema", "config.validation", "data.mixing", "data.read", "data.split",
                      "data.tasks"},  # -> Splits
    "data.token_table": {"data.tasks"},  # the cache's memory-mapped splits
    "data.cache": {"config.validation", "data.mixing", "data.read", "data.tasks", "data.token_table", "data.tokenize",
                   "utils.fileio"},
    "data.collate": {"data.tasks"},  # padded, padding-free and packed batches
    "data.order": set(),  # length-grouped sampling, packing into bins
    "data.sequence": {"data.collate"},  # sequence-parallel rows: each rank's shard
    "data": {"data.collate", "data.read", "data.split", "data.tasks", "data.tokenize"},  # the face: hands names on
    # modeling
    "modeling.moe": {"config.validation", "utils.compat"},  # MoE: the experts' layout, LoRA targets
    "modeling.moe_counts": {"modeling.moe", "utils.flops"},  # MoE: what a token uses, fake-tensor experts
    "modeling.attention": {"config.schema", "config.validation"},  # which attention: kernel, packing, SP
    "modeling.mixed_paths": {"utils.wrapped"},  # mixed-precision paths with fewer casts (bf16 autocast where it pays)
    "modeling.kernels": {"config.validation", "utils.wrapped"},  # model.kernels: Liger-Kernel's patches, by family
    "modeling.finetune": {"config.schema", "utils.compat"},  # what trains (lora | full) and in which dtypes
    "modeling.split_experts": set(),  # the split experts forward: grouped products on the routed tokens (torch only)
    "modeling.moe_lora": {"config.validation", "modeling.moe", "modeling.split_experts"},  # which expert LoRA path
    "modeling.tokens": {"config.schema", "config.validation"},  # added tokens, embedding rows, modules_to_save
    "modeling.build": {"config.schema", "config.validation", "modeling.finetune", "modeling.moe", "modeling.moe_lora",
                       "modeling.tokens", "utils.assets",
                       "utils.compat"},
    # packed rows' attention one example at a time where no varlen kernel runs
    "modeling.varlen": {"loss.tail", "modeling.mixed_paths", "utils.wrapped"},
    "modeling.dropout": set(),  # the dropout a model trains with; model.disable_dropout
    "modeling": {"modeling.build", "modeling.dropout"},  # the face: hands modeling.build's, dropout's names on
    # objectives: one file per objective; loss.objective picks one
    "objectives": {"config.schema", "config.validation", "loss.chunked", "loss.tail"},
    # planner: scale-plan's counts, meta/fake tensors, no process group
    "planner.census": {"config.load", "config.schema", "modeling.build", "modeling.finetune", "modeling.moe"},  # params
    # saved activations; objectives: the pairs' loss
    "planner.activations": {"config.schema", "loss.chunked", "loss.tail", "modeling.moe_counts",
                            "modeling.split_experts", "objectives", "planner.census"},
    # the MoE line; a MoE layer's peak
    "planner.moe": {"config.schema", "modeling.moe", "modeling.moe_counts", "modeling.moe_lora",
                    "modeling.split_experts", "planner.activations", "planner.census", "utils.flops"},
    "planner.pairs": {"config.schema", "objectives", "planner.activations", "planner.census", "utils.flops"},  # a preference job's
    "planner.rl": {"config.schema", "planner.activations", "utils.flops"},  # grpo: rollout KV cache, no-grad forwards
    # where each launch mode keeps the bytes; modeling: the sequence-parallel guard, for the SP columns
    "planner.layouts": {"config.load", "config.schema", "modeling.attention", "modeling.finetune", "planner.activations",
                        "planner.census", "planner.pairs"},  # finetune: what trains and in which dtypes (WeightsPlan)
    "planner.plan": {"config.schema", "data.tokenize", "modeling.build", "planner.activations", "planner.census",
                     "planner.layouts", "planner.moe", "planner.pairs", "planner.rl", "utils.assets"},  # data: the tails
    "planner.autobatch": {"config.schema", "config.validation", "planner.census", "planner.layouts",
                          "planner.plan"},  # the micro-batch search; train.micro_batch_size=auto at start-up
    "planner": {"planner.autobatch"},  # the face: the run's one door (plan_micro_batch)
    # distributed: may import accelerate / torch.distributed
    "distributed.topology": {"config.validation"},  # processes per machine (torch only where a GPU driver is)
    "distributed.rendezvous": set(),
    "distributed.collective": set(),  # on_every_rank, main_process_first, shared_run_id
    # paths, output_dir, GPU-only kernels, trackers: checked before any process group
    "distributed.inputs": {"config.schema", "config.validation"},
    "distributed.ulysses": {"data.sequence"},
    "distributed.frozen": set(),  # a frozen model (the full run's reference) wrapped as the policy is  # sequence-parallel attention, loaders, eval forward (DeepSpeed Ulysses)
    "distributed.launch": {"config.load", "config.schema", "config.validation", "distributed.inputs",
                           "distributed.rendezvous", "distributed.topology"},
    "distributed.launcher": {"config.load", "distributed.topology"},  # scale-train --accelerate-config (no torch)
    "distributed": set(),  # the face: hands nothing on
    # generation
    "generation.export": {"config.load", "config.schema", "data.tasks", "modeling.build", "modeling.moe",
                          "modeling.tokens", "utils.fileio"},  # serving files, the merged model
    "generation.generator": {"config.load", "config.schema", "data.tasks", "generation.export", "modeling.build",
                             "modeling.moe", "modeling.tokens"},  # answering as the run trained
    "generation.rollout": set(),  # rl.generator: the rollout interface and the transformers engine (seeded sampling)
    "generation.vllm": {"generation.rollout"},  # rl.generator=vllm: a colocated vLLM engine, the adapter synced
    "generation": set(),  # the face: hands nothing on
    # training: may import accelerate / torch.distributed
    "training.state": {"config.validation"},  # TrainerState, SaveTimer, a resume's global batch
    "training.schedule": {"config.schema"},
    "training.precision": {"config.schema", "distributed.launch", "modeling.finetune", "utils.fileio",
                           "utils.flops"},  # mixed_precision=auto, peak FLOP/s
    "training.metrics": {"config.schema", "utils.fileio", "utils.flops"},
    "training.checks": {"modeling.build"},
    "training.best": {"config.validation", "training.state", "utils.fileio"},  # train.keep_best, early stopping
    "training.tracking": {"config.load", "config.schema", "training.metrics", "utils.fileio"},
    "training.evaluate": {"data.tasks", "loss.tail", "objectives", "utils.signals"},
    "training.windows": {"loss.tail", "objectives", "training.state", "utils.signals"},  # one all-gather per step
    # the package training/checkpoint/: store, resume rules, save/load, the portable state any launch mode loads
    "training.checkpoint": {"config.load", "config.schema", "config.validation", "distributed.launch",
                            "modeling.build", "modeling.dropout", "training.state", "utils.fileio"},
    "training.samples": {"training.checkpoint", "training.tracking", "utils.signals"},  # generation at each eval
    # online RL: one round of rollouts (sampled, scored, batched) for loss.objective=grpo
    "training.rollouts": {"data.collate", "data.tasks", "generation.rollout", "objectives"},
    # training/parts/: each part of a run builds itself (launch, data, model, loaders, ...)
    "training.parts": {"config.schema", "config.validation", "data.cache", "data.collate", "data.mixing", "data.order",
                       "data.read", "data.sequence", "data.tasks", "data.token_table", "data.tokenize",
                       "distributed.collective", "distributed.frozen", "distributed.launch", "distributed.ulysses",
                       "generation.export",
                       "generation.rollout", "generation.vllm", "modeling.attention", "modeling.build",
                       "modeling.dropout", "modeling.finetune", "modeling.kernels", "modeling.mixed_paths",
                       "modeling.moe", "modeling.moe_counts", "modeling.moe_lora", "modeling.varlen", "objectives",
                       "planner", "training.best",
                       "training.checkpoint", "training.evaluate", "training.metrics", "training.precision",
                       "training.rollouts", "training.samples", "training.schedule", "training.state",
                       "training.tracking", "utils.assets", "utils.signals"},
    "training.startup": {"config.names", "config.schema", "data.token_table", "data.tokenize", "distributed.launch",
                         "training.checks", "training.parts", "training.precision", "training.schedule",
                         "utils.compat"},  # the start-up lines
    "training.job": {"config.load", "config.schema", "data.tasks", "distributed.launch", "distributed.ulysses",
                     "modeling.build", "objectives", "training.checkpoint", "training.metrics", "training.parts",
                     "training.precision", "training.samples", "training.startup", "training.state"},
    "training.commit": {"training.job", "training.metrics", "training.windows"},  # when a step is applied
    "training": set(),  # the face: hands nothing on
    # root: the loop and the commands
    "train": {"config.schema", "distributed.ulysses", "generation.export", "training.best", "training.checkpoint",
              "training.checks", "training.commit", "training.evaluate", "training.job", "training.metrics",
              "training.samples", "training.state", "training.tracking", "training.windows", "utils.signals"},
    "cli": {"config.help", "config.load", "config.schema", "config.validation", "data.mixing", "data.read",
            "data.tokenize", "distributed.inputs", "distributed.launch", "distributed.launcher", "modeling.build",
            "train", "training.checkpoint", "training.commit", "utils.assets", "utils.logs", "utils.signals"},
    # scale-plan; state: --resume reads a checkpoint's trainer_state.json
    "plan": {"config.help", "config.load", "config.schema", "config.validation", "planner.autobatch",
             "planner.census", "planner.layouts", "planner.plan", "training.state", "utils.logs"},
    "export": {"config.help", "config.load", "generation.export", "modeling.build", "utils.logs"},  # scale-export
    "generate": {"config.help", "generation.generator", "modeling.build", "utils.logs"},  # scale-generate
    # scale-lm-eval: the eval split (token cache, samples' prompt/answer split) as a harness task
    "lmeval": {"config.help", "config.load", "data.cache", "data.read", "data.tasks", "generation.export",
               "modeling.build", "training.samples", "utils.assets", "utils.fileio", "utils.logs"},
    "prepare": {"config.help", "config.load", "config.validation", "data.cache", "data.read", "data.token_table",
                "modeling.build", "utils.assets", "utils.logs"},  # scale-prepare
    "report": {"config.help", "config.load", "config.validation", "training.metrics", "training.schedule"},
    "env": {"utils.compat"},  # scale-env: versions, devices, CPU flags and launcher variables for a bug report
    "assets": {"utils.assets"},  # kept for scripts outside the package (and python -m scale.assets)
    "job": {"training.job"},  # kept for scripts outside the package
}
# Rooms that may import accelerate / torch.distributed / deepspeed (distributed, training and the root's loop only).
DISTRIBUTED = {"distributed.collective", "distributed.frozen", "distributed.inputs", "distributed.launch", "distributed.rendezvous",
               "distributed.ulysses", "training.checkpoint", "training.checks", "training.commit",
               "training.evaluate", "training.job", "training.metrics", "training.parts", "training.precision",
               "training.samples", "training.startup", "training.tracking", "training.windows", "train", "cli"}

# Each wing's layers, bottom first. A room imports rooms of its own layer or below (and wings below its own); an
# import into a higher layer runs upward. The data stages are one layer each, in the order rows flow: files,
# sources, formats, split, mixing, tokens, cache, batches. A wing's face sits on top of its wing.
LAYERS: dict[str, list[set[str]]] = {
    "utils": [{"utils.fileio", "utils.logs", "utils.signals", "utils.compat", "utils.flops", "utils.wrapped"},
              {"utils.assets"}, {"utils"}],
    "config": [{"config.validation", "config.sections"}, {"config.schema"}, {"config.names"},
               {"config.load", "config.help"}, {"config"}],
    "loss": [{"loss.tail"}, {"loss.chunked"}, {"loss"}],
    "data": [{"data.read"}, {"data.sources"}, {"data.tasks"}, {"data.split"}, {"data.mixing"}, {"data.tokenize"},
             {"data.token_table", "data.cache"}, {"data.collate", "data.order", "data.sequence"}, {"data"}],
    "modeling": [{"modeling.moe", "modeling.split_experts", "modeling.attention", "modeling.mixed_paths",
                  "modeling.kernels", "modeling.dropout", "modeling.finetune", "modeling.tokens"},
                 {"modeling.moe_lora", "modeling.moe_counts", "modeling.build", "modeling.varlen"}, {"modeling"}],
    "objectives": [{"objectives"}],
    "planner": [{"planner.census"}, {"planner.activations", "planner.moe"},
                {"planner.pairs", "planner.rl", "planner.layouts"},
                {"planner.plan"}, {"planner.autobatch"}, {"planner"}],
    "distributed": [{"distributed.topology", "distributed.rendezvous", "distributed.collective", "distributed.inputs",
                     "distributed.ulysses", "distributed.frozen"}, {"distributed.launch", "distributed.launcher"}, {"distributed"}],
    "generation": [{"generation.export", "generation.rollout"}, {"generation.generator", "generation.vllm"},
                   {"generation"}],
    "training": [{"training.state", "training.schedule", "training.precision", "training.metrics", "training.checks"},
                 {"training.best", "training.tracking", "training.evaluate", "training.windows",
                  "training.checkpoint", "training.rollouts"},
                 {"training.samples"}, {"training.parts"}, {"training.startup"}, {"training.job"},
                 {"training.commit"}, {"training"}],
    "root": [{"train", "plan", "export", "generate", "lmeval", "prepare", "report", "env"}, {"cli"},
             {"assets", "job"}],
}
# Packages that are one room each (their modules are read as one): the formats, the objectives, the checkpoint, the
# parts of a run. Every other module is a room of its own, named by its dotted path under scale/.
PACKAGE_ROOMS = ("data.tasks", "objectives", "training.checkpoint", "training.parts")
# The loop's modules: no print, no empty_cache, no len(batch), no host read (.item()).
LOOP = ("train", "training.commit", "training.windows", "training.evaluate", "loss.tail", "training.metrics")
# Imports of scale modules inside a function, each deferring a heavy library: `scale-train --help` and
# `--accelerate-config` import neither torch nor accelerate (scale/cli.py's module comment), and start_fast imports
# the loop with the garbage collector paused. Nothing else may import inside a function.
DEFERRED = {("cli", "training.checkpoint"), ("cli", "training.commit"), ("cli", "data.mixing"), ("cli", "data.read"),
            ("cli", "data.tokenize"), ("cli", "distributed.inputs"), ("cli", "distributed.launch"),
            ("cli", "modeling.build"), ("cli", "train")}


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


@functools.cache
def _file_imports(path: Path) -> tuple[tuple[str, bool], ...]:
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
    return tuple(found)


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


def _wing(room: str) -> str:
    """The wing of a room: its first name under ``scale/`` (``planner.census`` -> ``planner``), else ``root``."""
    first = room.split(".")[0]
    return first if first in WINGS and first != "root" else "root"


def test_every_module_is_in_the_table():
    rooms = {_room(name) for name in _modules()} - {None}
    assert rooms == set(ALLOWED), f"add to / remove from ALLOWED: {rooms ^ set(ALLOWED)}"
    assert list(LAYERS) == list(WINGS), "one entry of LAYERS per wing, in the wings' order"
    layered = [room for rooms_ in LAYERS.values() for layer in rooms_ for room in layer]
    assert sorted(layered) == sorted(set(ALLOWED)), f"give each room one layer: {set(layered) ^ set(ALLOWED)}"
    strays = {room: wing for wing, layers in LAYERS.items() for layer in layers for room in layer
              if _wing(room) != wing}
    assert strays == {}, f"a room's layer is in its own wing: {strays}"


MAX_LINES = 450  # a module longer than this holds more than one subject: split it where the subject changes


def test_no_module_over_max_lines():
    """No module of the package is over :data:`MAX_LINES` lines."""
    long = {p.relative_to(ROOT).as_posix(): n for p in sorted(SCALE.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_wings_stand_in_order():
    """A wing may import only wings below it (listed before it): the table itself has no circle and runs down."""
    order = list(WINGS)
    assert order[-1] == "root"
    for wing, below in WINGS.items():
        assert all(order.index(b) < order.index(wing) for b in below), f"{wing} may import a wing above it"
    assert set(PLAIN) < set(WINGS) and set(FOR_OUTSIDE) <= set(ALLOWED)


def test_wings_import_only_the_wings_they_may():
    wrong = sorted({f"{a} -> {b}" for a, b, _ in _links() if a != "scale"
                    and _wing(_room(b)) != _wing(_room(a)) and _wing(_room(b)) not in WINGS[_wing(_room(a))]})
    assert wrong == [], f"imports into a wing its row in WINGS does not list: {wrong}"


@pytest.mark.parametrize("wing", [w for w in WINGS if w != "root"])
def test_each_wing_face_says_what_it_holds_and_may_import(wing):
    """The wing's ``__init__.py`` opens with what lives there and ends its docstring with the wings it may import,
    the same as its row in :data:`WINGS` (``Imports nothing of scale`` for none)."""
    doc = ast.get_docstring(ast.parse((SCALE / wing / "__init__.py").read_text(encoding="utf-8"))) or ""
    said = [p for p in doc.split("\n\n") if p.startswith("Imports")]
    assert said, f"scale/{wing}/__init__.py: end the docstring with a paragraph 'Imports ...'"
    words = {t.split(".")[1] if t.startswith("scale.") else t for t in re.findall(r"\w+(?:\.\w+)*", said[-1])}
    named = words & set(WINGS) - {wing}
    assert named == set(WINGS[wing]), f"scale/{wing}/__init__.py names {sorted(named)}, WINGS {sorted(WINGS[wing])}"


def test_the_run_consults_the_planner_through_one_function():
    """Outside the planner only ``scale-plan`` (root ``plan``) reads its modules; the loop imports its face, which
    hands on one function (``plan_micro_batch``: the micro-batch search and the under-used-GPU line)."""
    inside = sorted({f"{a} -> {b}" for a, b, _ in _links() if _wing(_room(b)) == "planner"
                     and _wing(_room(a)) != "planner" and _room(a) != "plan" and _room(b) != "planner"})
    assert inside == [], f"the planner's internals imported from outside it: {inside}"
    face = ast.parse((SCALE / "planner" / "__init__.py").read_text(encoding="utf-8"))
    handed = {a.name for node in face.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert handed == {"MicroBatch", "plan_micro_batch"}


def test_faces_for_scripts_outside_are_imported_by_nothing_inside():
    users = sorted({f"{a} -> {b}" for a, b, _ in _links() if a != "scale" and _room(b) in FOR_OUTSIDE
                    and _room(a) != _room(b)})
    assert users == [], f"import the module, not the face or the re-export module: {users}"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_module_imports_only_what_the_table_allows(room):
    imported = _imports(room)
    ours = {_room(m) for m in imported if m.startswith("scale.")} - {room, None}
    assert ours <= ALLOWED[room], f"{room} imports {sorted(ours - ALLOWED[room])}, not in its row"
    distributed = {m for m in imported if m.startswith(("accelerate", "torch.distributed", "deepspeed"))}
    if room not in DISTRIBUTED:
        assert not distributed, f"{room} is plain-tensor code but imports {sorted(distributed)}"
    assert not (room in DISTRIBUTED and _wing(room) in PLAIN), f"{room} is in a plain-tensor wing"


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
    """Every import stays in its layer or goes down: into a lower layer of its wing, or into a wing below (the
    package's own ``scale/__init__.py``, above every layer, imports scale.utils.signals to exit at once on a signal
    while the libraries load)."""
    order = list(WINGS)
    layer = {room: (order.index(wing), i) for wing, layers in LAYERS.items() for i, rooms in enumerate(layers)
             for room in rooms}
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
