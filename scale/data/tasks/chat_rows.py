"""Chat rows: a ``messages`` cell read into a list of turns (roles, tool calls with their arguments decoded once,
reasoning) and a ``tools`` column, as the chat template takes them (:mod:`scale.data.tasks.messages`).
"""

from __future__ import annotations

import json
from typing import Any

from scale.config.schema import DataConfig
from scale.data.read import DataError

ROLES = ("system", "user", "assistant", "tool")


PLAIN_KEYS = {"role", "content"}


# OpenAI's linking metadata: which call a tool result answers, and a tool result's function name. No common
# tool-aware template renders them (Qwen2.5/Qwen3, Hermes and Llama 3.1 render a tool message's content only), and
# they are no trained text: a template that ignores them is not reported as a problem.
LINKING_KEYS = {"tool_call_id"}


LINKING_KEYS_OF_TOOL_MESSAGES = {"name"}


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # where chat data holds an assistant turn's reasoning


TOOLS_TEMPLATE = "chatml_tools"  # configs/chat/chatml_tools.jinja: ChatML with <tools> and <tool_call>


def _arguments(call: Any, i: int, path: str, j: int) -> Any:
    """A tool call whose ``arguments`` is a JSON string, with it decoded once into its value (OpenAI's format
    carries ``"arguments": "{\"city\": \"Oslo\"}"``; transformers' templates write ``arguments | tojson``, so a
    string would be encoded a second time). Calls as ``{"function": {...}}`` or flat ``{name, arguments}``.

    Raises:
        DataError: the string is not JSON.
    """
    if not isinstance(call, dict):
        return call
    fn = call.get("function") if isinstance(call.get("function"), dict) else None
    args = (fn if fn is not None else call).get("arguments")
    if not isinstance(args, str):
        return call
    try:
        value = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
        name = (fn if fn is not None else call).get("name")
        raise DataError(f"row {i} of {path}: message {j} calls {name!r} with arguments that are not JSON ({e.msg}: "
                        f"{args[:80]!r}); write them as a JSON object (a string or a mapping)") from None
    return {**call, "function": {**fn, "arguments": value}} if fn is not None else {**call, "arguments": value}


def read_messages(value: Any, column: str, i: int, path: str) -> list[dict[str, Any]]:
    """Check one row's conversation; every key of a message is kept (the template decides what it renders), a
    tool call's JSON-string ``arguments`` decoded into a mapping.

    Raises:
        DataError: not a non-empty list of messages, a role outside :data:`ROLES`, content that is not text (an
            assistant turn with ``tool_calls`` may have none), tool-call arguments that are not JSON, no assistant
            turn, a last turn that is not the assistant's or is empty.
    """
    if isinstance(value, str):  # a CSV cell holding JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, list) or not value:
        raise DataError(f"row {i} of {path}: {column!r} must be a non-empty list of {{role, content}} messages, "
                        f"got {type(value).__name__}")
    messages = []
    for j, m in enumerate(value):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (
                isinstance(m.get("content"), str) or calls and m.get("content") is None):
            raise DataError(f"row {i} of {path}: message {j} must be {{'role': one of {list(ROLES)}, 'content': "
                            f"text}}, got {m!r}"[:400])
        m = {**m, "content": m.get("content") or ""}
        if calls:
            m["tool_calls"] = [_arguments(c, i, path, j) for c in m["tool_calls"]]
        messages.append(m)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"row {i} of {path}: no assistant message; the messages format trains assistant turns "
                        f"(data.train_on), so every conversation needs one")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"row {i} of {path}: the last message is from {messages[-1]['role']!r}, not 'assistant'; "
                        f"a conversation ends with an assistant turn (the row is cut after it), so end every "
                        f"conversation with one")
    if not messages[-1]["content"].strip() and not messages[-1].get("tool_calls"):
        raise DataError(f"row {i} of {path}: the last assistant message is empty")
    return messages


def read_tools(raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
    tools = raw.get(cfg.tools_column)
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            pass
    if tools in (None, "", []):
        return {}
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"row {i} of {path}: {cfg.tools_column!r} must be a list of tool (function) schemas, got "
                        f"{type(tools).__name__}")
    return {"tools": tools}


def conversational_row(raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
    """A TRL conversational prompt/completion row (both lists of messages) as a chat whose completion's
    assistant turns are the trained ones (``completion_from``: the index of the completion's first message)."""
    prompt, completion = raw.get(cfg.prompt_column), raw.get(cfg.completion_column)
    if not isinstance(prompt, list) or not isinstance(completion, list) or not completion:
        raise DataError(f"row {i} of {path}: a conversational row needs {cfg.prompt_column!r} and "
                        f"{cfg.completion_column!r} both as lists of messages (the completion non-empty); got "
                        f"{type(prompt).__name__} and {type(completion).__name__}")
    messages = read_messages(prompt + completion, f"{cfg.prompt_column} + {cfg.completion_column}", i, path)
    return {"messages": messages, "completion_from": len(prompt), **read_tools(raw, cfg, i, path)}
