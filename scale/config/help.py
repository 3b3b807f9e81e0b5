"""The config's reference, generated from the schema: ``scale-train --help [TOPIC]`` (:func:`keys_help`), the key
table and ``docs/config.md`` (:func:`config_doc`), and the command docstrings as ``--help`` prints them
(:func:`help_text`).

    python -m scale.config.help > docs/config.md
"""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
import types
import typing
from typing import Any

import yaml

from scale.config.names import TRL_NAMES, default_of, other_name, schema_fields, suggest, trl_table
from scale.config.schema import Config
from scale.config.validation import ConfigError


def type_text(tp: Any) -> str:
    """A schema annotation as the help shows it: ``int``, ``float | null``, ``list[str] | str``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_text(arm) for arm in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        (arm,) = typing.get_args(tp)
        return f"list[{'mapping' if dataclasses.is_dataclass(arm) else type_text(arm)}]"
    if typing.get_origin(tp) is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _yaml_text(value: Any) -> str:
    """A default as it would be written on the command line (``null``, ``true``, ``[q_proj, v_proj]``)."""
    if isinstance(value, str) and "\n" in value:
        return json.dumps(value)  # one line: "Review: {text}\nSentiment: {label}"
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def help_table() -> str:
    """Markdown table of every key: its type, default and help text (``docs/config.md``)."""
    rows = ["| key | type | default | meaning (unit) |", "|---|---|---|---|"]
    for key, tp, f in schema_fields():
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{key}` | {type_text(tp).replace('|', chr(92) + '|')} | `{default_of(f)!r}` | {help_text} |")
    return "\n".join(rows)


def _first_sentence(text: str, width: int = 110) -> str:
    """The first sentence of a help text, cut at a word to ``width`` characters."""
    match = re.search(r"\.(?=\s+[A-Z(`]|$)", text)
    first = text[:match.end()] if match else text
    if len(first) > width:
        first = first[:width - 3].rsplit(" ", 1)[0] + "..."
    return first


_ROLE = re.compile(r":(?:data|func|class|attr|meth|mod|obj|exc):`~?([^`]+)`")


def help_text(doc: str) -> str:
    """A module docstring as a command's ``--help`` prints it: reST roles and inline-literal quotes dropped
    (``:data:`X``` -> ``X``, a double-backquoted ``x`` -> ``x``), the rest as written."""
    return _ROLE.sub(r"\1", doc).replace("``", "")


def keys_help(topic: str | None = None) -> str:
    """The config keys as ``scale-train --help [TOPIC]`` prints them.

    Args:
        topic: None or ``""``: every key on one line each (type, default, the first sentence of its help); a
            section (``optim``): its keys with their whole help; a key (``optim.lr``): that key; ``trl``: the
            TRL/transformers names and their scale keys; a TRL/transformers name (``learning_rate``): its key.

    Raises:
        ConfigError: ``topic`` is none of these (the message suggests the closest keys).
    """
    fields = schema_fields()
    if not topic:
        lines = ["config keys: section.key=value on the command line (values parse as YAML), or in the --config "
                 "YAML;", "scale-train --help SECTION or KEY: whole help texts; --help trl: TRL/transformers names "
                 "-> scale keys", ""]
        width = max(len(k) for k, _, _ in fields)
        section = None
        for key, tp, f in fields:
            head = key.split(".")[0] if "." in key else ""
            if head != section:
                section = head
                doc = (typing.get_type_hints(Config)[head].__doc__ or "").split("\n")[0] if head else "the run"
                lines.append(f"{head or '(top level)'}: {doc}")
            lines.append(f"  {key:<{width}}  {type_text(tp)} = {_yaml_text(default_of(f))}  "
                         f"{_first_sentence(f.metadata.get('help', ''))}")
        return "\n".join(lines) + "\n"
    if topic.lower() in ("trl", "transformers", "hf"):
        return "\n".join(f"{n.name:<30} -> {', '.join(n.keys) or '(none)'}" + (f"  ({n.note})" if n.note else "")
                          for n in TRL_NAMES) + "\n"
    chosen = [(k, tp, f) for k, tp, f in fields if k == topic or k.startswith(topic + ".") or
              k.startswith(topic + "[")]
    if not chosen:
        trl = other_name(topic) if "." not in topic else None
        if trl is not None:
            return f"{trl.name} (TRL/transformers, default {trl.default}) -> {', '.join(trl.keys) or '(none)'}" + \
                (f": {trl.note}" if trl.note else "") + "\n"
        sections = sorted({k.split(".")[0] for k, _, _ in fields if "." in k})
        hint = suggest(topic)  # as an override of that key would be answered
        raise ConfigError(f"--help {topic}: no such section or key{': ' + hint if hint else ''} (sections: "
                          f"{', '.join(sections)}; --help trl lists TRL/transformers names)")
    out = []
    for key, tp, f in chosen:
        out.append(f"{key}: {type_text(tp)} = {_yaml_text(default_of(f))}")
        out += textwrap.wrap(f.metadata.get("help", ""), width=100, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out) + "\n"


CONFIG_DOC_HEADER = """# Config reference

Every key, its type, its schema default and its unit. The shipped YAMLs (`configs/train/default.yaml`, which plain
`scale-train` runs, and `tiny_cpu.yaml`) set some of them differently. Override any key on the command line as
`section.key=value` (values parse as YAML: `lora.target_modules=[q_proj,v_proj]`, `loss.type_weights=null`;
text that YAML would read as a mapping, such as `Text: {text}`, stays text; `None` is null, as `wandb agent` writes
it; a mapping for a whole section, `optim={lr: 0.002}`, sets those keys and keeps the section's others). Unknown
keys and wrong types are errors that name the key and the closest keys (a TRL/transformers name gets its scale
key). `scale-train --help` lists every key on one line, `scale-train --help optim` one section in full.

This page is generated from the schema (`scale/config/schema.py`, its data/loss/rl sections in
`scale/config/sections.py`) and `scale/config/names.py`; `tests/test_config.py` fails when it is stale. Regenerate it with `python -m scale.config.help > docs/config.md`.

## `train.micro_batch_size: auto`

On a GPU the start-up picks the largest micro-batch whose memory plan (`scale-plan`'s one-device row: model states,
saved activations, logits, transient bytes, framework overhead) fits `train.auto_memory_fraction` of the device,
before the accelerator, a DeepSpeed config or the loaders read the batch, and logs one line:

```
train.micro_batch_size=auto: micro_batch_size 48 x gradient_accumulation_steps 1 x 2 data-parallel rank(s) =
global_batch_size 96 (kept: train.auto_global_batch_size); planned 52.3 GiB of 139.8 GiB per device
(train.auto_memory_fraction 0.75)
```

- `train.auto_global_batch_size: G` keeps a global batch: the micro-batch is the largest that fits and divides
  `G / data-parallel ranks`, and `gradient_accumulation_steps` makes up the rest. Without it (null, the default)
  `gradient_accumulation_steps` stays as set and the global batch grows with the micro-batch; the learning rate is
  not rescaled, so set `G` to keep a tuned recipe's batch.
- `train.auto_memory_fraction` (default 0.75): the plan was 0.80-0.98 of the measured peak on an H200 (QLoRA
  lowest), so a plan at 0.75 of the device should peak below ~0.94 of it.
- `config.yaml` and the checkpoints record the numbers it resolved to; a resume resolves `auto` again and keeps
  the checkpoint's global batch as for any other change of micro-batch.
- On a CPU `auto` is refused in one line: the largest micro-batch host RAM holds is not the fastest there (CPU
  GEMMs saturate at a few rows), and RAM is shared with the OS and the data loader.
- A GPU run with a set micro-batch whose plan uses under a quarter of the device says so at start-up and names
  `train.micro_batch_size: auto`. `scale-plan train.micro_batch_size=auto --gpus 1 --gpu-mem 141` shows the choice.
- Every rank plans alike (same config, same device size); ranks with GPUs of different sizes need a number. The
  one-device plan holds the whole model's states, so under ZeRO-3/FSDP2 (sharded) or sequence parallelism the choice
  is conservative. The plan's fake forwards take seconds (one plan of the default job: 13 s on 2 busy CPU cores;
  `auto` runs 4 or more), paid once at start-up.

## From TRL / transformers

TRL's `SFTConfig` (TRL 1.16; the fields it inherits from transformers 5's `TrainingArguments`), peft's `LoraConfig`
and `BitsAndBytesConfig`, and the scale key that does the same. A run logs at start-up the settings in which it
differs from TRL's defaults (`unlike TRL: ...` lines). The ones that surprise most:

- the schedule: 10 warmup steps, then cosine decay to 0.1 x `optim.lr` (TRL: linear to 0, no warmup); `optim.lr`
  2e-4 (TRL 2e-5);
- truncation: a row longer than `data.max_length` (128; TRL 1024) loses its *oldest* tokens, so the trained end
  survives (TRL's `keep_start` cuts the end);
- evaluation at step 0, every `train.eval_every` steps and at the end (TRL: none unless `eval_strategy`);
- what is trained: a chat's assistant turns, a completion, a label (+ EOS), or a text row's last
  `loss.threshold` tokens (TRL: every token unless `completion_only_loss`/`assistant_only_loss`);
- `train.micro_batch_size` is per device, as `per_device_train_batch_size`; `global_batch_size =
  micro_batch_size x gradient_accumulation_steps x num_processes`.

"""


def config_doc() -> str:
    """``docs/config.md``: the header, the TRL/transformers table and every key (:func:`help_table`)."""
    return CONFIG_DOC_HEADER + trl_table() + "\n\n## Every key\n\n" + help_table() + "\n"


if __name__ == "__main__":  # python -m scale.config.help > docs/config.md
    import sys

    sys.stdout.write(config_doc())
