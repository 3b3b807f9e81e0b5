"""Reading and writing configs: YAML instances of the schema (:mod:`scale.config.schema`), dotted command-line
overrides, shipped named configs and secret redaction. The generated reference (``--help``, ``docs/config.md``) is
:mod:`scale.config.help`.

Unknown keys and wrong types are errors that name the dotted key. The schema's classes are in
:mod:`scale.config.schema`, :class:`~scale.config.validation.ConfigError` in :mod:`scale.config.validation`.

    cfg = load_config("configs/train/tiny_cpu.yaml", ["train.max_steps=50", "optim.lr=1e-3"])

No torch, no accelerate: this module is imported by every other one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from scale.config.names import suggest
from scale.config.schema import Config, DatasetConfig
from scale.config.validation import ConfigError
from scale.utils.fileio import write_text_atomic



def configs_dir() -> Path:
    """The shipped configs: ``scale/configs/`` in an installed wheel (``pyproject.toml`` maps the repository's
    top-level ``configs/`` there), the repository's ``configs/`` in a checkout or an editable install."""
    here = Path(__file__).resolve().parent.parent  # scale/
    return next((d for d in (here / "configs", here.parent / "configs") if (d / "train").is_dir()),
                here.parent / "configs")


DEFAULT_CONFIG = configs_dir() / "train" / "default.yaml"
# Keys naming input files: a relative path in a config file is read relative to that file (when it exists there).
FILE_KEYS = ("data.path", "data.eval_path", "data.chat_template", "model.name_or_path", "model.tokenizer", "train.deepspeed_config")


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


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float where a float is asked)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):  # an entry of data.datasets
        return _build(tp, value, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        if value == "None" and type(None) in typing.get_args(tp):  # Python's null: `wandb agent` passes --key=None
            return None
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
    if origin is dict:  # data.chat_template_kwargs: template variables, any YAML values under text keys
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected a mapping with text keys")
        return dict(value)
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
    if typing.get_args(tp) and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return "a list of mappings such as [{path: data/a.jsonl, weight: 1}]"
    return getattr(tp, "__name__", None) if not typing.get_args(tp) else str(tp).replace("typing.", "")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        example = " (e.g. {path: data/a.jsonl, weight: 1})" if cls is DatasetConfig else ""
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping{example}, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        key = f"{prefix}{unknown[0]!s}"
        more = f" (and {len(unknown) - 1} more unknown: {', '.join(map(str, unknown[1:4]))})" if len(unknown) > 1 else ""
        hint = suggest(key, None if cls is not DatasetConfig else [f"{prefix}{n}" for n in sorted(names)])
        if hint:
            raise ConfigError(f"unknown config key {key}: {hint}{more}")
        raise ConfigError(f"unknown config key {key}; known keys in {prefix.rstrip('.') or 'the top level'}: "
                          f"{sorted(names)}{more}; scale-train --help lists them")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, tp)
    return cls(**kwargs)


def _unknown_keys(cls: type, data: Any, prefix: str = "") -> list[str]:
    """Every dotted key of the mapping ``data`` that the schema section ``cls`` does not have, in file order
    (the entries of ``data.datasets`` are checked when they are built)."""
    if not isinstance(data, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out = []
    for name, value in data.items():
        if name not in fields:
            out.append(f"{prefix}{name!s}")
        elif dataclasses.is_dataclass(hints[name]):
            out += _unknown_keys(hints[name], value, f"{prefix}{name}.")
    return out


def unknown_keys_message(path: Path, keys: list[str]) -> str:
    """One line naming the config file and each of its unknown ``keys`` with the closest key
    (:func:`scale.config.names.suggest`)."""
    hints = [suggest(k) or "no close key (scale-train --help lists them)" for k in keys]
    if len(keys) == 1:
        return f"{path}: unknown config key {keys[0]}: {hints[0]}"
    return f"{path}: {len(keys)} unknown config keys: " + "; ".join(f"{k}: {h}" for k, h in zip(keys, hints))


# Other tools' names for a key, read as the key itself (never written back: config.yaml holds the key).
ALIASES = {"model.finetuning_type": "model.finetune"}  # LLaMA-Factory's finetuning_type: lora | full


def _apply_aliases(tree: dict[str, Any]) -> None:
    """Rename every :data:`ALIASES` key found in ``tree`` to its key, in place.

    Raises:
        ConfigError: both the alias and the key are set to different values.
    """
    for alias, key in ALIASES.items():
        section, _, name = alias.partition(".")
        node = tree.get(section)
        if not isinstance(node, dict) or name not in node:
            continue
        value, own = node.pop(name), key.partition(".")[2]
        if own in node and node[own] != value:
            raise ConfigError(f"{alias}={value!r} and {key}={node[own]!r} disagree ({alias} is another name for "
                              f"{key}); set only {key}")
        node[own] = value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``tree[a][b] = value`` for ``a.b``; a number indexes a list (``data.datasets.1.weight=2``)."""
    parts = dotted.split(".")
    node: Any = tree
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {dotted}: {'.'.join(parts[:k])} has {len(node)} entries; index it "
                                  f"with 0..{len(node) - 1}")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {parts[k - 1]} is not a section")
        if last:
            node[part] = value
        elif isinstance(node, dict) and part not in node and parts[k + 1].isdigit():
            raise ConfigError(f"override {dotted}: {'.'.join(parts[:k + 1])} has no entry {parts[k + 1]}; set the "
                              f"whole list first ({'.'.join(parts[:k + 1])}=[{{path: a.jsonl}}, ...])")
        else:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]


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
    _apply_aliases(tree)
    unknown = _unknown_keys(Config, tree)
    if unknown:  # every one, naming the file (an override's unknown key is named when the config is built)
        raise ConfigError(unknown_keys_message(path, unknown))
    for key in FILE_KEYS:
        section, _, name = key.partition(".")
        value = tree.get(section, {}).get(name) if isinstance(tree.get(section), dict) else None
        if isinstance(value, str) and not Path(value).expanduser().is_absolute() \
                and (path.parent / value).exists():
            tree[section][name] = str((path.parent / value).resolve())
    mixture = tree.get("data", {}).get("datasets") if isinstance(tree.get("data"), dict) else None
    for entry in mixture if isinstance(mixture, list) else []:  # data.datasets[i].path: as data.path
        value = entry.get("path") if isinstance(entry, dict) else None
        if isinstance(value, str) and not Path(value).expanduser().is_absolute() and (path.parent / value).exists():
            entry["path"] = str((path.parent / value).resolve())
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        for dotted, value in _key_by_key(key.strip(), _parse_value(raw)):
            _set_dotted(tree, dotted, value)
        _apply_aliases(tree)
    ds = tree.get("train", {}).get("deepspeed_config") if isinstance(tree.get("train"), dict) else None
    if isinstance(ds, str) and not Path(ds).exists() and (configs_dir() / "deepspeed" / f"{ds}.json").is_file():
        tree["train"]["deepspeed_config"] = str(configs_dir() / "deepspeed" / f"{ds}.json")  # a shipped name
    return _build(Config, tree, "")


def _is_section(dotted: str) -> bool:
    """Whether ``dotted`` names a section of the schema (``optim``, ``data.datasets.0``), not a key."""
    tp: Any = Config
    for part in dotted.split("."):
        if typing.get_origin(tp) is list and part.isdigit():
            tp = typing.get_args(tp)[0]
        elif dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
        else:
            return False
    return dataclasses.is_dataclass(tp)


def _key_by_key(dotted: str, value: Any) -> list[tuple[str, Any]]:
    """An override as ``(dotted key, value)`` pairs: a mapping given for a whole section (``optim={lr: 0.002}``,
    as ``wandb agent`` passes a nested sweep parameter: ``--optim={'lr': 0.002}``) sets its keys one by one, so
    the section's other keys keep the values of the config file instead of the schema defaults."""
    if isinstance(value, dict) and _is_section(dotted):
        return [pair for k, v in value.items() for pair in _key_by_key(f"{dotted}.{k}", v)]
    return [(dotted, value)]


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
PATH_KEYS = ("output_dir", "model.name_or_path", "model.tokenizer", "data.path", "data.eval_path", "data.chat_template",
             "train.deepspeed_config", "train.resume_from")


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


def dump_config(cfg: Config, path: str | Path, comment: str | None = None) -> None:
    """Write the resolved config to ``path`` (YAML); ``load_config(path)`` reads it back equal. ``comment`` (e.g. the
    launch's data- and sequence-parallel degrees, which no key holds alone) goes first, as YAML comment lines."""
    head = "".join(f"# {line}\n" for line in comment.splitlines()) if comment else ""
    write_text_atomic(path, head + yaml.safe_dump(to_dict(cfg), sort_keys=False))
