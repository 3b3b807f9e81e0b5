"""The chat template: found (``data.chat_template``: a shipped name, a file, or the tokenizer's), named, and
rendered, with the template's own errors and a clock it reads turned into one line each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scale.config.load import configs_dir
from scale.config.schema import DataConfig
from scale.data.read import DataError


def chat_template_path(value: str | None) -> Path | None:
    """``data.chat_template`` as a file: the path itself, else a shipped template of that name
    (``chatml``, ``chatml_tools``: ``configs/chat/<name>.jinja``); ``None`` when neither exists."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path
    shipped = configs_dir() / "chat" / f"{path.name.removesuffix('.jinja')}.jinja"
    return shipped if len(path.parts) == 1 and shipped.is_file() else None


def chat_template(tokenizer: Any, cfg: DataConfig) -> str:
    """The chat template (Jinja text): ``data.chat_template``'s file (or shipped name), else the tokenizer's own.

    Raises:
        DataError: the file does not exist, or there is no template at all.
    """
    if cfg.chat_template is not None:
        path = chat_template_path(cfg.chat_template)
        if path is None:
            shipped = sorted(p.stem for p in (configs_dir() / "chat").glob("*.jinja"))
            raise DataError(f"data.chat_template={cfg.chat_template!r} is not a file; point it at a Jinja "
                            f"chat-template file, or name a shipped one: {shipped}")
        return path.read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError("the messages format needs a chat template and this tokenizer has none; set "
                        "data.chat_template to a Jinja file (e.g. the chat_template of a tokenizer_config.json "
                        "of the same model family), or write the data as prompt/completion columns")
    return template


def template_name(cfg: DataConfig) -> str:
    """The chat template in words, for messages: ``data.chat_template=...`` or the tokenizer's own."""
    if cfg.chat_template is not None:
        return f"data.chat_template={cfg.chat_template}"
    return "the tokenizer's chat template"


def special_strings(tokenizer: Any) -> list[str]:
    """The spellings of the tokenizer's special (control) tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = set(tokenizer.all_special_tokens) | {t.content for t in added.values() if getattr(t, "special", False)}
    return sorted((s for s in specials if s), key=len, reverse=True)


class ClockError(Exception):
    """The template called ``strftime_now`` (raised by the probe to stop the render)."""


def render(tokenizer: Any, template: str, messages: list[dict[str, Any]], i: int, generation: bool = False,
           tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text for ``messages`` (``tokenize=False``).

    Raises:
        DataError: the template raised (``raise_exception`` or any error): one line naming the row and the
            template's own message.
    """
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation, **(kwargs or {}))
    except ClockError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or a template's own TypeError/KeyError
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"row {i}: the chat template refuses this conversation ({type(e).__name__}: {msg}); fix "
                        f"the row or data.chat_template") from None
