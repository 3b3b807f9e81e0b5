"""``classification``: ``data.template`` rendered with the row's ``text`` and ``label``; the label's tokens + EOS
are trained. Evaluation ranks every label after the prompt (``eval/accuracy``) and reports the label's NLL.

Labels and file values are compared after :func:`scale.data.read.normalize_label` (Unicode NFC, stripped). A
label's tokens are exactly the tokens that follow the rendered prompt: a separator before ``{label}`` that is
its own token (a newline, a colon) belongs to the prompt, never to the label.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import DataError, normalize_label, text_cell
from scale.data.tasks.base import Builder, Example, Task, encode
from scale.loss.tail import forward_tail

_FIELD = re.compile(r"\{(text|label)\}")


def render_template(template: str, text: str, label: str) -> str:
    """``template`` with ``{text}`` and ``{label}`` replaced; every other character (braces too) is literal."""
    return _FIELD.sub(lambda m: text if m.group(1) == "text" else label, template)


def label_sequences(tokenizer: Any, cfg: DataConfig) -> list[list[int]]:
    """The tokens of each label as it appears at the end of the rendered template (EOS not included).

    The prompt is the template rendered with an empty label. When its tokens are a prefix of the rendered
    row's, the label's tokens are the rest. Otherwise the prompt's trailing whitespace merges into the label's
    first token (``Sentiment: {label}`` -> `` positive``): the label's tokens follow the prompt without it.

    Returns:
        One token list per entry of ``data.labels`` (one token for a word like ``positive``).

    Raises:
        DataError: a label's tokens merge with the template text before it, or two labels share tokens.
    """
    prompt = render_template(cfg.template, "x", "")
    seqs = []
    for label in (normalize_label(x) for x in cfg.labels):
        full = encode(tokenizer, render_template(cfg.template, "x", label))
        seq = None
        for cut in (prompt, prompt.rstrip()):
            base = encode(tokenizer, cut)
            rest = full[len(base):]
            if full[:len(base)] == base and rest and tokenizer.decode(rest) == prompt[len(cut):] + label \
                    and (cut == prompt or tokenizer.decode(rest[:1]).strip()):
                seq = rest
                break
        if seq is None:
            raise DataError(f"data.labels: {label!r} does not tokenize apart from the template text before it "
                            f"in data.template={cfg.template!r}; put a space or a newline before '{{label}}'")
        seqs.append(seq)
    if len({tuple(s) for s in seqs}) != len(seqs):
        raise DataError(f"data.labels={cfg.labels} map to repeated tokens {seqs}; use distinct labels")
    return seqs


def label_token_ids(tokenizer: Any, cfg: DataConfig) -> list[int] | None:
    """Token id of each label when every label is one token (the fast accuracy path), else ``None``."""
    seqs = label_sequences(tokenizer, cfg)
    return [s[0] for s in seqs] if all(len(s) == 1 for s in seqs) else None


@dataclass
class TargetStats:
    """Per-example classification figures at the target position.

    Attributes:
        logprob: ``[B]`` log-probability (nats) of ``target_token``.
        correct: ``[B]`` 1.0 where the target is the argmax over the label tokens, else 0.0.
    """

    logprob: Tensor
    correct: Tensor


@torch.no_grad()
def target_stats(tail_logits: Tensor, target_token: Tensor, label_token_ids: Tensor | None,
                 position: int) -> TargetStats:
    """Log-probability of each row's target token and label-set accuracy (single-token labels).

    Args:
        tail_logits: ``[B, N, V]`` predictions of the tail tokens.
        target_token: ``[B]`` token id of each row's label word.
        label_token_ids: ``[L]`` token ids of the label set; ``None``: no accuracy (``correct`` is 0).
        position: which tail token is the target, counted from the end (``-1`` = last real token); its
            prediction is ``tail_logits[:, N + position]``.

    Returns:
        :class:`TargetStats`.
    """
    logits = tail_logits[:, tail_logits.shape[1] + position].float()        # [B, V]
    logprob = logits.log_softmax(-1).gather(1, target_token[:, None]).squeeze(1)
    if label_token_ids is None:
        return TargetStats(logprob=logprob, correct=torch.zeros_like(logprob))
    pred = label_token_ids[logits[:, label_token_ids].argmax(-1)]
    return TargetStats(logprob=logprob, correct=(pred == target_token).float())


@torch.no_grad()
def sequence_logprob(tail_logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` sum of the log-probabilities (nats) of the tokens where ``mask [B, N]`` is 1."""
    token = tail_logits.float().log_softmax(-1).gather(2, targets[:, :, None]).squeeze(2)   # [B, N]
    return token.masked_fill(mask == 0, 0.0).sum(1)


def label_candidates(batch: dict[str, Tensor], label_seqs: list[list[int]], pad_token_id: int, padding_side: str,
                     with_eos: bool = True) -> list[dict[str, Tensor]]:
    """For log-likelihood ranking: each row's prompt (the row without its tail) followed by every label.

    Args:
        batch: a classification batch (any device); every row's tail is its label's tokens, then EOS.
        label_seqs: the tokens of each label.
        pad_token_id, padding_side: how the candidates are padded.
        with_eos: score each label with the EOS that ends every trained tail (the row's last token).

    Returns:
        One batch (``input_ids``, ``attention_mask``, ``tail_mask``) per label, on the batch's device: row ``b``
        is ``prompt_b + label_seqs[l] (+ EOS)`` with the label's tokens (+ EOS) as its tail. Built on the host
        (evaluation only).
    """
    device = batch["input_ids"].device
    ids, mask = batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    tails = batch["tail_mask"].sum(1).tolist()
    real = [[t for t, m in zip(r, mk) if m] for r, mk in zip(ids, mask)]
    prompts = [r[:len(r) - n] for r, n in zip(real, tails)]
    out = []
    for seq in label_seqs:
        rows = [(p + seq + r[-1:], len(seq) + 1) if with_eos else (p + seq, len(seq)) for p, r in zip(prompts, real)]
        T, N = max(len(x) for x, _ in rows), max(n for _, n in rows)
        cand_ids = torch.full((len(rows), T), pad_token_id, dtype=torch.long)
        cand_mask = torch.zeros((len(rows), T), dtype=torch.long)
        tail = torch.zeros((len(rows), N), dtype=torch.long)
        for b, (x, n) in enumerate(rows):
            span = slice(T - len(x), T) if padding_side == "left" else slice(0, len(x))
            cand_ids[b, span] = torch.tensor(x, dtype=torch.long)
            cand_mask[b, span] = 1
            tail[b, N - n:] = 1
        out.append({"input_ids": cand_ids.to(device), "attention_mask": cand_mask.to(device),
                    "tail_mask": tail.to(device)})
    return out


class Classification(Task):
    """The ``classification`` format."""

    name = "classification"
    types_are_labels = True

    def columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.text_column, cfg.label_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        value = raw.get(cfg.label_column)
        label = normalize_label(value) if value is not None else None
        if label not in [normalize_label(x) for x in cfg.labels]:
            raise DataError(f"row {i} of {path}: label {label!r} is not in data.labels={cfg.labels}; "
                            f"fix the row or add the label to data.labels")
        return {"text": text_cell(raw, cfg.text_column, i, path), "label": label}

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        self.seqs = label_sequences(tokenizer, data_cfg)
        self.labels = [normalize_label(x) for x in data_cfg.labels]
        pad = tokenizer.pad_token_id
        self.pad_token_id = 0 if pad is None else pad  # evaluation pads its label candidates with it (masked)

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        return [render_template(cfg.template, row["text"], row["label"])]

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | None:
        i, tok = row.get("row", -1), b.tokenizer
        label = self.labels.index(row["label"])
        full = encode(tok, render_template(b.cfg.template, row["text"], row["label"]))
        seq = self.seqs[label]
        if full[-len(seq):] != seq:
            got = [tok.decode([t]) for t in full[-len(seq):]]
            raise DataError(f"row {i}: the label {row['label']!r} tokenizes as {got} at the end of this row, not "
                            f"as {[tok.decode([t]) for t in seq]}; put a space or newline before '{{label}}' "
                            f"in data.template")
        tail = b.with_eos(seq)
        prefix, prompt = b.front(full[:-len(seq)])
        ids = b.assemble(prefix, prompt, tail, i)
        if ids is None:
            return None
        return Example(ids, len(tail), int(row.get("type", label)), seq[0] if len(seq) == 1 else 0, label, i)

    def info(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        seqs = self.seqs
        return {"label_seqs": seqs, "label_token_ids": [s[0] for s in seqs] if all(len(s) == 1 for s in seqs)
                else None}

    @torch.no_grad()
    def label_scores(self, model: torch.nn.Module, batch: dict[str, Tensor], spec: Any) -> Tensor:
        """``[B, L]`` log-likelihood (nats) of every label + EOS after each row's prompt: one forward per label.

        Each label is scored as it is trained, with its EOS: a label that is a token prefix of another
        (``recommend`` / ``recommend against``) then ranks by whether the answer ends there.
        """
        scores = []
        for cand in label_candidates(batch, self.found["label_seqs"], self.pad_token_id, spec.padding_side):
            logits, targets = forward_tail(model, cand, padding_side=spec.padding_side)
            scores.append(sequence_logprob(logits, targets, cand["tail_mask"]))
        return torch.stack(scores, dim=1)

    def eval_columns(self, model: torch.nn.Module, batch: dict[str, Tensor], tail_logits: Tensor, targets: Tensor,
                     spec: Any) -> list[Tensor]:
        ids = self.found.get("label_token_ids")
        if ids is not None:                                   # the fast path: one forward
            ids = torch.as_tensor(ids, device=tail_logits.device)
            stats = target_stats(tail_logits, batch["target_token"], ids, -2)   # label, then EOS
            return [stats.logprob, stats.correct]
        label_mask = batch["tail_mask"].clone()
        label_mask[:, -1] = 0                                 # every tail ends with EOS
        scores = self.label_scores(model, batch, spec)         # [B, L]
        return [sequence_logprob(tail_logits, targets, label_mask), (scores.argmax(1) == batch["label"]).float()]

    def summary(self, sums: list[float], n: int, spec: Any) -> dict[str, float]:
        return {"eval/target_nll": -sums[0] / n, "eval/accuracy": sums[1] / n}
