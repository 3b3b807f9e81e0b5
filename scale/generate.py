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
its tokenizer without one, :func:`scale.export.serving_tokenizer`) gets each prompt's text as it trained, after
the tokenizer's BOS where it adds one, as ``samples.jsonl`` shows it; ``--system``, ``--chat``, ``--messages`` and
the interactive chat are refused. Decoding is ``model.generate``: greedy at ``--temperature 0`` (the default),
else sampled with ``--temperature``/``--top-p``/``--top-k`` after ``torch.manual_seed(--seed)`` (the same command
prints the same text on the same machine), stopping at EOS and at the trained end-of-turn marker
(:func:`scale.export.serving_tokenizer`) or after ``--max-new-tokens``. Bad input is one line naming the flag or
the line, exit code 2, before the model loads. No accelerate import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scale.config.help import help_text
from scale.config.load import load_config
from scale.config.schema import ModelConfig
from scale.data.tasks.base import encode, special_affixes
from scale.export import serving_tokenizer
from scale.modeling.build import keep_bitsandbytes_out, load_base, load_tokenizer
from scale.modeling.moe import explicit_targets
from scale.utils.logs import configure_logging

logger = logging.getLogger("scale.generate")  # also under `python -m scale.generate`

Messages = list[dict[str, Any]]


class GenerateError(ValueError):
    """Bad input to ``scale-generate``: one line naming the flag (or the input line) and the fix."""


@dataclass
class Sampling:
    """How answers are decoded.

    Attributes:
        temperature: 0 = greedy (``do_sample=False``); > 0 samples from the softmax of ``logits / temperature``.
        top_p: nucleus sampling mass in (0, 1]; 1 = off. Sampling only.
        top_k: keep the ``top_k`` most likely tokens; 0 = off (transformers' own default would be 50). Sampling only.
        max_new_tokens: the most tokens an answer gets (tokens), its stop token included.
        seed: ``torch.manual_seed`` before the first answer: the same inputs give the same sampled text.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0

    def check(self) -> None:
        """Refuse values out of range.

        Raises:
            GenerateError: a value out of its range, naming the flag.
        """
        if not self.temperature >= 0:
            raise GenerateError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"--top-p {self.top_p}: must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise GenerateError(f"--top-k {self.top_k}: must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")

    def generate_kwargs(self) -> dict[str, Any]:
        """The ``model.generate`` keywords: greedy, or sampling with every knob set (none left to the model's
        ``generation_config``, whose defaults differ between models)."""
        if self.temperature == 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens}


@dataclass
class Generator:
    """A loaded model and what it needs to answer as its run trained.

    Attributes:
        model: the causal LM (merged, or a ``PeftModel`` on the base), in eval mode.
        tokenizer: the run's tokenizer, its chat template the trained one.
        stops: token ids generation stops at (EOS and the trained end-of-turn marker).
        template_kwargs: the run's ``data.chat_template_kwargs`` (template variables).
    """

    model: torch.nn.Module
    tokenizer: Any
    stops: list[int]
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def has_template(self) -> bool:
        """The run trained through a chat template: its saved tokenizer carries one. Training saves it only when the
        prepared task rendered the rows with one (:func:`scale.export.serving_tokenizer`); else prompts are text."""
        return bool(getattr(self.tokenizer, "chat_template", None))


def run_config_near(path: Path) -> Path | None:
    """The ``config.yaml`` of the run ``path`` belongs to: ``path`` itself, ``adapter/``'s or ``merged/``'s parent."""
    for d in (path, path.parent):
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    return None


def _run_dir(path: Path) -> Path | None:
    """The run directory ``path`` names (itself, or ``adapter/``'s parent); None for a model directory.

    Raises:
        FileNotFoundError: ``path`` is neither a model directory, a run directory nor a run's ``adapter/``.
    """
    if (path / "config.json").exists():  # merged/ (scale-export) or any HF causal LM
        return None
    run_dir = path.parent if (path / "adapter_config.json").exists() else path
    if not (run_dir / "config.yaml").exists() or not (run_dir / "adapter" / "adapter_config.json").exists():
        raise FileNotFoundError(f"{path} is neither a model directory (config.json), a run directory (config.yaml "
                                f"and adapter/) nor a run's adapter/")
    return run_dir


def load_serving(path: str | Path) -> tuple[Any, list[int]]:
    """``(tokenizer, stop_ids)`` of a merged/plain HF model directory, a run directory or a run's ``adapter/``: the
    tokenizer as the run saved it (its chat template, or none) and the tokens generation stops at. No model is
    loaded: flags are checked against it first.

    Raises:
        FileNotFoundError: ``path`` is none of these.
    """
    from transformers import AutoTokenizer, GenerationConfig

    path = Path(path)
    run_dir = _run_dir(path)
    if run_dir is not None:
        tokenizer, stops, _ = serving_tokenizer(load_config(run_dir / "config.yaml"), run_dir)
        return tokenizer, stops
    tokenizer = AutoTokenizer.from_pretrained(path)
    stops = GenerationConfig.from_pretrained(path).eos_token_id if (path / "generation_config.json").exists() \
        else tokenizer.eos_token_id
    return tokenizer, stops if isinstance(stops, list) else [stops]


def model_config(path: str | Path) -> ModelConfig:
    """How :func:`load_model` loads ``path``: the run's ``model`` section, or the model directory itself.

    Raises:
        FileNotFoundError: ``path`` is neither a model directory, a run directory nor a run's ``adapter/``.
    """
    run_dir = _run_dir(Path(path))
    if run_dir is None:
        return ModelConfig(name_or_path=str(path), quantize_4bit=False)
    return load_config(run_dir / "config.yaml").model


def load_model(path: str | Path) -> torch.nn.Module:
    """The model of a merged/plain HF model directory, or a run's base with its ``adapter/`` (a ``PeftModel``), in
    eval mode.

    Raises:
        FileNotFoundError: ``path`` is none of these.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    run_dir = _run_dir(path)
    if run_dir is None:
        return AutoModelForCausalLM.from_pretrained(path).eval()
    from peft import PeftModel

    cfg = load_config(run_dir / "config.yaml")
    base = load_base(cfg.model, len(load_tokenizer(cfg.model)), cfg.train.seed)
    with explicit_targets():  # a mixture-of-experts adapter names its targets in full (scale.modeling.moe)
        return PeftModel.from_pretrained(base, run_dir / "adapter").eval()


def load_for_generation(path: str | Path) -> tuple[torch.nn.Module, Any, list[int]]:
    """``(model, tokenizer, stop_ids)``: :func:`load_model` and :func:`load_serving`.

    Raises:
        FileNotFoundError: ``path`` is neither a model directory, a run directory nor a run's ``adapter/``.
    """
    tokenizer, stops = load_serving(path)
    return load_model(path), tokenizer, stops


def template_kwargs(path: str | Path) -> dict[str, Any]:
    """The run's ``data.chat_template_kwargs`` when the ``config.yaml`` of the run ``path`` belongs to is found."""
    config = run_config_near(Path(path))
    return dict(load_config(config).data.chat_template_kwargs or {}) if config is not None else {}


def load_generator(path: str | Path) -> Generator:
    """:func:`load_for_generation` plus the run's ``data.chat_template_kwargs`` (:func:`template_kwargs`).

    Raises:
        FileNotFoundError: see :func:`load_for_generation`.
    """
    model, tokenizer, stops = load_for_generation(path)
    return Generator(model, tokenizer, stops, template_kwargs(path))


def render_chat(tokenizer: Any, messages: Messages, template_kwargs: dict[str, Any] | None = None) -> str:
    """``messages`` through the tokenizer's chat template, ending with the generation prompt (the text
    ``transformers serve`` tokenizes for the same request)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(template_kwargs or {}))


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """One user message through the chat template with the generation prompt; the text itself without one."""
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, [{"role": "user", "content": prompt}])
    return prompt


def plain_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A prompt's tokens as a run without a chat template trained them: the tokenizer's special prefix (its BOS,
    where it adds one; SmolLM2: none) once, then the text (:meth:`scale.data.tasks.base.Builder.front`)."""
    prefix, _ = special_affixes(tokenizer)
    ids = encode(tokenizer, prompt)
    return ids if ids[:len(prefix)] == prefix else prefix + ids


@torch.no_grad()
def complete(model: torch.nn.Module, tokenizer: Any, prompt_ids: list[int], stops: list[int],
             sampling: Sampling) -> str:
    """The completion of ``prompt_ids`` by ``model.generate`` (one row: no padding question).

    Args:
        model: a causal LM in eval mode.
        tokenizer: decodes the answer (and gives the pad id).
        prompt_ids: the prompt's tokens (template, generation prompt and BOS in them).
        stops: token ids that end an answer (EOS, the end-of-turn marker).
        sampling: the decoding. Its seed is not set here (:func:`answer_all` sets it once).

    Returns:
        The new tokens decoded without special tokens, stripped.
    """
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=next(model.parameters()).device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), eos_token_id=stops,
                         pad_token_id=tokenizer.pad_token_id, **sampling.generate_kwargs())
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def generate_texts(model: torch.nn.Module, tokenizer: Any, prompts: list[str], stops: list[int],
                   max_new_tokens: int = 64, sampling: Sampling | None = None) -> list[str]:
    """Completions of already rendered ``prompts`` (:func:`complete`), one at a time.

    Args:
        model: a causal LM in eval mode.
        tokenizer: encodes each prompt without adding special tokens (the rendered text holds them).
        prompts: rendered prompt texts (chat template and generation prompt applied).
        stops: token ids that end an answer (EOS, the end-of-turn marker).
        max_new_tokens: used when ``sampling`` is ``None`` (greedy).
        sampling: the decoding; default greedy.

    Returns:
        One answer per prompt.
    """
    sampling = sampling or Sampling(max_new_tokens=max_new_tokens)
    return [complete(model, tokenizer, encode(tokenizer, text), stops, sampling) for text in prompts]


def answer(gen: Generator, messages: Messages, sampling: Sampling) -> str:
    """The model's next assistant turn after ``messages`` (text, special tokens dropped, stripped): rendered by the
    run's chat template, or (a run without one) the last message's text as a plain prompt."""
    if gen.has_template:
        ids = encode(gen.tokenizer, render_chat(gen.tokenizer, messages, gen.template_kwargs))
    else:
        ids = plain_prompt_ids(gen.tokenizer, messages[-1]["content"])
    return complete(gen.model, gen.tokenizer, ids, gen.stops, sampling)


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
