"""Tokens added to the tokenizer, the embedding rows they need, and the modules trained in full beside a LoRA adapter
(``lora.modules_to_save``). No accelerate.

    add_tokens(tokenizer, cfg.model)              # model.new_tokens / new_special_tokens, in load_tokenizer
    grow_embeddings(model, len(tokenizer), seed)  # as transformers' resize_token_embeddings, before LoRA wraps it
    peft_save_kwargs(model, lora_cfg, grew)       # modules_to_save (+ ensure_weight_tying) for peft's LoraConfig

The rows are added by transformers' own ``resize_token_embeddings(n, mean_resizing=True)`` (its default: the new
rows of the input embeddings and of an untied head are drawn from a normal with the old rows' mean and covariance,
https://nlp.stanford.edu/~johnhew/vocab-expansion.html), drawn under ``torch.random.fork_rng`` seeded by
``train.seed``, so every rank of a run draws the same rows and the global RNG is left as it was. The embeddings never
shrink (a vocabulary padded past the tokenizer stays).
"""

from __future__ import annotations

from typing import Any

import torch

from scale.config.schema import LoraConfig, ModelConfig
from scale.config.validation import ConfigError

# peft's LoraConfig.ensure_weight_tying (keep a head tied to the embeddings tied under modules_to_save) arrived in
# peft 0.18.0 (huggingface/peft#2803); pyproject's lower bound is 0.15.
TYING_PEFT = "0.18.0"


def add_tokens(tokenizer: Any, cfg: ModelConfig) -> int:
    """Add ``model.new_tokens`` (``tokenizer.add_tokens``) and ``model.new_special_tokens`` (``add_special_tokens``'s
    ``additional_special_tokens``, appended to the tokenizer's own) to ``tokenizer`` in place. Returns its length."""
    if cfg.new_tokens:
        tokenizer.add_tokens(list(cfg.new_tokens))
    if cfg.new_special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(cfg.new_special_tokens)},
                                     replace_extra_special_tokens=False)
    return len(tokenizer)


def embedding_rows(model: torch.nn.Module) -> int:
    """Rows of ``model``'s input embeddings (a ZeRO-3 partitioned weight: its full ``ds_shape``)."""
    weight = model.get_input_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def grow_embeddings(model: torch.nn.Module, rows: int, seed: int, base_vocab: int | None = None) -> int | None:
    """Grow ``model``'s input embeddings (and an untied LM head) to ``rows`` as transformers does:
    ``model.resize_token_embeddings(rows, mean_resizing=True)``, the new rows drawn from ``seed`` (the global RNG kept).
    Under ZeRO-3 transformers gathers the partitioned weights itself (every rank calls).

    Args:
        model: a transformers ``PreTrainedModel`` (before LoRA wraps it).
        rows: the tokenizer's length (``len(tokenizer)``).
        seed: ``train.seed``.
        base_vocab: the tokenizer's vocabulary without its added tokens (``tokenizer.vocab_size``). Embeddings
            shorter than it belong to a model made for another tokenizer: the missing rows are not added tokens,
            and nothing is grown.

    Returns:
        The rows before, or None when nothing changed (``rows`` does not exceed them, or they are short of
        ``base_vocab``).
    """
    before = embedding_rows(model)
    if rows <= before or (base_vocab is not None and before < base_vocab):
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(rows, mean_resizing=True)
    return before


def ties_head(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LM head shares its weight with the input embeddings (SmolLM2, the tiny Llama)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def _module_name(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _named(name: str | None, wanted: list[str]) -> bool:
    """peft's rule for a ``modules_to_save`` entry: the module's full name, or a suffix of it after a dot."""
    return name is not None and any(name == w or name.endswith(f".{w}") for w in wanted)


def peft_save_kwargs(model: torch.nn.Module, lora: LoraConfig, grew: int | None, new_keys: str) -> dict[str, Any]:
    """The ``modules_to_save`` arguments of peft's ``LoraConfig`` for ``model`` (before ``get_peft_model``), checked.

    A copy of ``lora.modules_to_save`` (peft extends the list it is given); ``ensure_weight_tying=True`` when the head
    is tied to the embeddings and either is named, so peft trains one copy the two share (without it peft trains
    untied copies, and a merged model saved with ``tie_word_embeddings`` would keep one of them).

    Args:
        model: the base, embeddings grown already.
        lora: the lora section.
        grew: :func:`grow_embeddings`'s answer (None: no rows added).
        new_keys: what added the rows, for the message (``model.new_tokens=[...]`` or the tokenizer's length).

    Raises:
        ConfigError: rows were added and the input embeddings (or an untied head) are not in ``lora.modules_to_save``
            (their new rows would never train); an entry names no module; a tied head with an installed peft older
            than 0.18 (no ``ensure_weight_tying``).
    """
    save = list(lora.modules_to_save or [])
    names = [n for n, _ in model.named_modules()]
    unknown = [w for w in save if not any(n == w or n.endswith(f".{w}") for n in names)]
    if unknown:
        raise ConfigError(f"lora.modules_to_save: {unknown} name no module of this {type(model).__name__}")
    embed = _module_name(model, model.get_input_embeddings())
    head = _module_name(model, model.get_output_embeddings())
    tied = ties_head(model)
    short = [n.rsplit(".", 1)[-1] for n in (embed, head) if n is not None and not (tied and n == head)]
    trained = _named(embed, save) or tied and _named(head, save)  # peft's tying wraps the other one too
    if not tied and head is not None:
        trained = trained and _named(head, save)
    if grew is not None and not trained:
        raise ConfigError(f"{new_keys}: the embeddings grew from {grew} rows and LoRA leaves the new rows untrained; "
                          f"set lora.modules_to_save={short}{' (the head is tied to them)' if tied else ''} or "
                          f"model.finetune=full")
    if not save:
        return {}
    kwargs: dict[str, Any] = {"modules_to_save": save}
    if tied and (_named(embed, save) or _named(head, save)):
        import inspect

        import peft
        from peft import LoraConfig as PeftLoraConfig

        if "ensure_weight_tying" not in inspect.signature(PeftLoraConfig).parameters:
            raise ConfigError(f"lora.modules_to_save={save} on a model whose head is tied to its embeddings needs peft "
                              f">= {TYING_PEFT} (ensure_weight_tying; peft {peft.__version__} would train two untied "
                              f"copies): pip install 'peft>={TYING_PEFT}', or model.finetune=full")
        kwargs["ensure_weight_tying"] = True
    return kwargs
