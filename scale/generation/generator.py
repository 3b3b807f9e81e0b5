"""Generation with a trained run as it trained: the model and tokenizer loaded from a merged/plain model directory, a
run directory or a run's ``adapter/`` (:func:`load_generator`), the run's chat template and end-of-turn stop
(:func:`scale.generation.export.serving_tokenizer`), prompts rendered as it trained (:func:`render_chat`,
:func:`plain_prompt_ids`), and decoding by ``model.generate`` (:class:`Sampling`, :func:`complete`, :func:`answer`).
``scale-generate`` (:mod:`scale.generate`) is its command line; the run's samples and evaluation use the same
rendering. No accelerate import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scale.config.load import load_config
from scale.config.schema import ModelConfig
from scale.data.tasks.base import encode, special_affixes
from scale.generation.export import serving_tokenizer
from scale.modeling.build import load_base, load_tokenizer
from scale.modeling.moe import explicit_targets
from scale.modeling.tokens import grow_embeddings

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
        prepared task rendered the rows with one (:func:`scale.generation.export.serving_tokenizer`); else prompts are
        text."""
        return bool(getattr(self.tokenizer, "chat_template", None))


def run_config_near(path: Path) -> Path | None:
    """The ``config.yaml`` of the run ``path`` belongs to: ``path`` itself, ``adapter/``'s or ``merged/``'s parent."""
    for d in (path, path.parent):
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    return None


def _trained_dir(path: Path) -> Path:
    """``path``, or the ``model/`` of a full fine-tune's run directory (``config.yaml`` and ``model/config.json``, no
    ``adapter/``): the plain transformers directory that run trained."""
    if (path / "config.yaml").is_file() and (path / "model" / "config.json").is_file() \
            and not (path / "adapter" / "adapter_config.json").exists():
        return path / "model"
    return path


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

    path = _trained_dir(Path(path))
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
    path = _trained_dir(Path(path))
    run_dir = _run_dir(path)
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

    path = _trained_dir(Path(path))
    run_dir = _run_dir(path)
    if run_dir is None:
        return AutoModelForCausalLM.from_pretrained(path).eval()
    from peft import PeftModel

    cfg = load_config(run_dir / "config.yaml")
    run_tokenizer = load_tokenizer(cfg.model)
    rows = len(run_tokenizer)  # with model.new_tokens: the rows the run trained
    base = load_base(cfg.model, rows, cfg.train.seed)
    grow_embeddings(base, rows, cfg.train.seed, run_tokenizer.vocab_size)  # as the run grew them (the adapter trained them)
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


