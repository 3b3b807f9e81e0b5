"""``scale-generate``: chat with a trained run as it trained: its chat template, its end-of-turn stop.

    scale-generate runs/sft/merged --prompt "Hello, how are you?"               # the merged export (scale-export)
    scale-generate runs/sft --prompt "Hello" --system "Answer in one line."     # base + runs/sft/adapter
    scale-generate runs/sft --chat --prompt "Hi" --prompt "And then?"           # two user turns of one chat
    scale-generate runs/sft                                                     # a terminal: an interactive chat
    echo "What is AI?" | scale-generate runs/sft                                # stdin: one prompt a line
    scale-generate runs/sft --messages held_out.jsonl --jsonl                   # conversations, answered at the end
    scale-generate runs/sft --prompt "Hi" --temperature 0.7 --top-p 0.9 --seed 1   # sampled, reproducibly

Each ``--prompt`` (or line of ``--file``/stdin) is its own conversation: ``[--system,] user`` rendered with the
run's chat template and its generation prompt; with ``--chat`` they are the successive user turns of one
conversation, each answer appended before the next turn (on a terminal with no prompt given, lines typed are such
turns). ``--messages FILE`` (``-``: stdin) reads conversations as the training data holds them: one JSON object a
line with a ``messages`` list (or the list itself); a conversation that ends with an assistant turn is answered
from before that turn, as ``samples.jsonl`` is, and that turn is kept as ``reference``. ``--jsonl`` prints one
``{"messages": [..., answer], "reference"?}`` object a line (the training format, so an output line is the next
input); else ``>>> <last user message>`` and the answer.

The template is the one the run trained with (``adapter/`` and ``merged/`` carry it) and the run's
``data.chat_template_kwargs`` (read from its ``config.yaml``: the run directory, or the one ``merged/`` is in).
A run whose rows no chat template rendered (classification, plain text, text prompt/completion: training saves
its tokenizer without one, :func:`scale.generation.export.serving_tokenizer`) gets each prompt's text as it trained,
after the tokenizer's BOS where it adds one, as ``samples.jsonl`` shows it; ``--system``, ``--chat``, ``--messages`` and
the interactive chat are refused. Decoding is ``model.generate``: greedy at ``--temperature 0`` (the default),
else sampled with ``--temperature``/``--top-p``/``--top-k`` after ``torch.manual_seed(--seed)`` (the same command
prints the same text on the same machine), stopping at EOS and at the trained end-of-turn marker
(:func:`scale.generation.export.serving_tokenizer`) or after ``--max-new-tokens``. Bad input is one line naming the flag
or the line, exit code 2, before the model loads. No accelerate import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from scale.config.help import help_text
from scale.generation.generator import (GenerateError, Generator, Messages, Sampling, answer, load_model,
                                        load_serving, model_config, template_kwargs)
from scale.modeling.build import keep_bitsandbytes_out
from scale.utils.logs import configure_logging

logger = logging.getLogger("scale.generate")  # also under `python -m scale.generate`


def read_conversations(lines: Iterable[str], source: str) -> list[Messages]:
    """Conversations from JSON lines: ``{"messages": [...]}`` (the training format) or a bare list of messages;
    blank lines are skipped.

    Raises:
        GenerateError: a line that is not JSON, whose messages are not ``{role, content}`` objects with a string
            content (an assistant turn with ``tool_calls`` may have none), or that holds only an assistant turn
            (line numbers from 1, as an editor shows them).
    """
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise GenerateError(f"{source} line {n}: not JSON ({e.msg}); write one conversation a line, "
                                f'{{"messages": [{{"role": "user", "content": "..."}}]}}') from None
        messages = value.get("messages") if isinstance(value, dict) else value
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(m.get("content"), str) or (
                    m.get("role") == "assistant" and m.get("tool_calls") and m.get("content") is None))
                for m in messages):
            raise GenerateError(f"{source} line {n}: expected a non-empty list of {{role, content}} messages with "
                                f"text content under \"messages\" (or as the line itself)")
        if not split_reference(messages)[0]:
            raise GenerateError(f"{source} line {n}: nothing precedes the assistant turn; give the user turn it "
                                f"answers")
        out.append(messages)
    return out


def split_reference(messages: Messages) -> tuple[Messages, str | None]:
    """``(prompt messages, reference)``: a conversation that ends with an assistant turn loses that turn (its
    content is the reference), as ``samples.jsonl`` splits a held-out chat; else ``(messages, None)``."""
    if messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"]
    return messages, None


def with_system(messages: Messages, system: str | None) -> Messages:
    """``messages`` with a system turn ``system`` in front, unless ``system`` is None or one is there already."""
    if system is None or messages[0]["role"] == "system":
        return list(messages)
    return [{"role": "system", "content": system}, *messages]


def answer_all(gen: Generator, conversations: list[Messages], sampling: Sampling,
               emit: Callable[[Messages, str, str | None], None]) -> None:
    """Answer each conversation independently (seeded once, before the first) and ``emit(prompt messages, answer,
    reference)`` as it comes."""
    torch.manual_seed(sampling.seed)
    for messages in conversations:
        prompt, reference = split_reference(messages)
        emit(prompt, answer(gen, prompt, sampling), reference)


def chat(gen: Generator, turns: Iterable[str], system: str | None, sampling: Sampling,
         emit: Callable[[Messages, str, str | None], None]) -> Messages:
    """One conversation: each of ``turns`` is a user turn, answered (``emit``) and appended before the next.

    Returns:
        The whole conversation, answers included.
    """
    torch.manual_seed(sampling.seed)
    messages: Messages = [] if system is None else [{"role": "system", "content": system}]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply = answer(gen, messages, sampling)
        emit(list(messages), reply, None)
        messages.append({"role": "assistant", "content": reply})
    return messages


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scale-generate", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="merged/ (or any HF model dir), a run dir (base + adapter/), or adapter/")
    parser.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    parser.add_argument("--file", default=None, help="a file with one prompt a line")
    parser.add_argument("--messages", default=None, metavar="FILE",
                        help="JSON lines of conversations ({\"messages\": [...]} or a list); '-' reads stdin")
    parser.add_argument("--system", default=None, help="a system message before each conversation that has none")
    parser.add_argument("--chat", action="store_true",
                        help="the prompts are the successive user turns of one conversation")
    parser.add_argument("--jsonl", action="store_true",
                        help='print {"messages": [..., answer], "reference"?} lines instead of text')
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (sampling; 1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (sampling; 0 = off)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the first answer")
    return parser


def _inputs(args: argparse.Namespace) -> tuple[list[Messages] | None, list[str] | None, bool]:
    """``(conversations, chat turns, interactive)`` from the flags, stdin read here (before the model loads).

    Raises:
        GenerateError: unreadable files, bad JSON lines, or flags that do not go together.
    """
    if args.messages is not None:
        if args.prompt or args.file or args.chat:
            raise GenerateError("--messages: give conversations either as --messages or as --prompt/--file/--chat, "
                                "not both")
        source = "stdin" if args.messages == "-" else args.messages
        try:
            lines = sys.stdin.read().splitlines() if args.messages == "-" else \
                Path(args.messages).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise GenerateError(f"--messages {args.messages}: cannot read it ({e.strerror})") from None
        conversations = read_conversations(lines, source)
        if not conversations:
            raise GenerateError(f"--messages {args.messages}: no conversation in it")
        return [with_system(c, args.system) for c in conversations], None, False
    prompts = list(args.prompt)
    if args.file:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except OSError as e:
            raise GenerateError(f"--file {args.file}: cannot read it ({e.strerror})") from None
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts and sys.stdin.isatty():
        return None, None, True
    if not prompts:
        prompts = [line.strip() for line in sys.stdin if line.strip()]
    if not prompts:
        raise GenerateError("no prompt: give --prompt TEXT, --file F, --messages F, or lines on stdin")
    if args.chat:
        return None, prompts, False
    return [with_system([{"role": "user", "content": p}], args.system) for p in prompts], None, False


def check_plain_prompts(args: argparse.Namespace, interactive: bool) -> None:
    """A model without a chat template takes prompts as text: refuse what needs a conversation.

    Raises:
        GenerateError: ``--system``, ``--chat``, ``--messages`` or the interactive chat (one line, every such flag
            named).
    """
    asked = [flag for flag, given in (("--system", args.system is not None), ("--chat", args.chat),
                                      ("--messages", args.messages is not None), ("the interactive chat", interactive))
             if given]
    if asked:
        raise GenerateError(f"{args.path} has no chat template (its run trained on prompts as plain text, not rendered "
                            f"by one): {', '.join(asked)} need{'s' if len(asked) == 1 else ''} one; give each "
                            f"prompt's text as it trained with --prompt, --file or stdin")


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """``scale-generate PATH [--prompt TEXT]... [--file F | --messages F] [--system S] [--chat] [--jsonl]
    [--temperature T] [--top-p P] [--top-k K] [--max-new-tokens N] [--seed S]`` (module docstring).

    ``own_process``: this process answers and nothing else (:func:`cli`), so bitsandbytes stays out unless the
    model needs it (:func:`scale.modeling.build.keep_bitsandbytes_out`)."""
    args = _parser().parse_args(argv)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed)
    try:
        sampling.check()
        conversations, turns, interactive = _inputs(args)
        configure_logging(dict(os.environ))  # before transformers, peft and bitsandbytes are imported
        tokenizer, stops = load_serving(args.path)
        if not getattr(tokenizer, "chat_template", None):  # before the model loads
            check_plain_prompts(args, interactive)
        if own_process:
            keep_bitsandbytes_out(model_config(args.path))
        gen = Generator(load_model(args.path), tokenizer, stops, template_kwargs(args.path))
    except (GenerateError, FileNotFoundError) as e:
        sys.stderr.write(f"scale-generate: error: {e}\n")
        return 2

    def emit(messages: Messages, reply: str, reference: str | None) -> None:
        if args.jsonl:
            record: dict[str, Any] = {"messages": [*messages, {"role": "assistant", "content": reply}]}
            if reference is not None:
                record["reference"] = reference
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write(f">>> {messages[-1]['content']}\n{reply}\n")
        sys.stdout.flush()

    if interactive:  # a terminal: each line typed is the next user turn; end with Ctrl-D
        sys.stderr.write("scale-generate: chat with the model; one user turn a line, Ctrl-D ends\n")

        def typed() -> Iterable[str]:
            while True:
                try:
                    line = input(">>> ").strip()
                except EOFError:
                    return
                if line:
                    yield line

        chat(gen, typed(), args.system, sampling, lambda m, reply, r: sys.stdout.write(reply + "\n"))
    elif turns is not None and args.jsonl:  # one conversation: one line, every answer in it
        whole = chat(gen, turns, args.system, sampling, lambda *_: None)
        sys.stdout.write(json.dumps({"messages": whole}, ensure_ascii=False) + "\n")
    elif turns is not None:
        chat(gen, turns, args.system, sampling, emit)
    else:
        answer_all(gen, conversations, sampling, emit)
    return 0


def cli() -> None:
    """Console entry point (``scale-generate``)."""
    sys.exit(main(own_process=True))


if __name__ == "__main__":
    cli()
