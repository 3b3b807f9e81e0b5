"""Generation at each evaluation: greedy completions of held-out prompts, scored on the generated text.

``eval/exact_match`` is teacher forced (every answer token is the argmax *given the true prefix*), which flatters
a model (transformers#26474). At every evaluation (step 0, every ``train.eval_every``, the end) the first
``eval.generate_samples`` rows of the eval split are completed with ``model.generate`` (greedy, no sampling
code of ours) and compared, as text, with the answer the row trains:

| metric | meaning |
|---|---|
| ``eval/gen_exact_match`` | the generated text (special tokens dropped, stripped) equals the reference answer's |
| ``eval/gen_accuracy`` | classification: the generated text equals the row's label |
| ``eval/gen_samples`` | how many rows were generated |

A row's *prompt* is its tokens as trained up to its last trained answer (for a chat: every turn before the last
assistant turn, rendered by the trained template, ending with the generation prompt) and its *reference* is that
answer through its stop token (EOS or the template's end-of-turn marker:
:func:`scale.generation.export.serving_tokenizer`). Generation stops at those stops or after ``min(len(reference),
eval.max_new_tokens)`` tokens: a longer completion cannot match. Each completion goes to ``<output_dir>/samples.jsonl``
(``step, row, prompt, reference, completion, exact``; main process, one append per evaluation) and to a W&B table
``eval/samples``.

Preference pairs (``data.format: preference``): the first ``eval.generate_samples`` held-out *pairs*; the policy
answers their shared prompt (budget: the longer side), and each line holds ``step, row, prompt, completion,
chosen, rejected, exact`` (the completion equals chosen) with the pair's scores under the model of that step
(:meth:`scale.objectives.preference.PreferenceObjective.pair_scores`): ``logps`` (the policy's and, for DPO, the
reference's summed tail logps of chosen and rejected, nats), ``rewards`` (chosen, rejected, margin, as
``rewards/*``) and ``tokens`` (each side's tail).

Launch modes: with whole weights on every rank (single, DDP, ZeRO-1/2) rank ``r`` generates rows ``r, r + W,
...`` of the unwrapped model and the texts are all-gathered; with partitioned weights (ZeRO-3, FSDP) every rank
generates every row in lock-step on accelerate's unwrapped model (``synced_gpus=True``, as transformers' own
ZeRO-3 evaluation does), so each forward gathers its layers' shards and no rank ever holds the whole model.
Greedy decoding of one row at a time has no padding: the text is the same in every launch mode.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object
from transformers import StoppingCriteria, StoppingCriteriaList

from scale.training.checkpoint import unwrap
from scale.training.tracking import wandb_run
from scale.utils.signals import EvalInterrupted

logger = get_logger(__name__)

SAMPLES_FILE = "samples.jsonl"


@dataclass
class Sample:
    """One held-out row to complete.

    Attributes:
        row: the row's index in the data file.
        prompt_ids: the tokens before its last trained answer (as trained: template, BOS).
        reference_ids: the last trained answer's tokens, through its stop token.
        label: the row's label (classification), else ``None``.
        rejected_ids: a preference pair's rejected answer through its stop token (``reference_ids`` is the
            chosen one), else ``None``.
        pair: a preference pair's two examples ``[chosen, rejected]`` (what :attr:`Generation.score` scores).
    """

    row: int
    prompt_ids: list[int]
    reference_ids: list[int]
    label: str | None = None
    rejected_ids: list[int] | None = None
    pair: list[Any] | None = None


def last_answer(input_ids: list[int], tail_len: int, flags: list[int]) -> tuple[list[int], list[int]]:
    """``(prompt, reference)``: ``input_ids`` split before the last run of trained tail tokens (``flags``, one per
    tail token); the reference is that run. A single answer (a label, a completion) is the whole trained tail."""
    last = max(i for i, f in enumerate(flags) if f)
    first = last
    while first > 0 and flags[first - 1]:
        first -= 1
    start = len(input_ids) - tail_len
    return input_ids[:start + first], input_ids[start + first:start + last + 1]


def pick_samples(examples: Any, n: int, labels: list[str] | None = None, pairs: bool = False) -> list[Sample]:
    """The first ``n`` rows of the eval split (its order: the same in every launch mode) as :class:`Sample`; a row
    with a label index (classification: ``Example.label >= 0``) gets its label from ``labels``. With ``pairs``
    (a preference split: examples ``2p``, ``2p + 1`` the chosen and rejected side of pair ``p``), the first ``n``
    pairs: the shared prompt, the chosen answer as the reference and the rejected one beside it."""
    if pairs:
        out = []
        for p in range(min(n, len(examples) // 2)):
            chosen, rejected = examples[2 * p], examples[2 * p + 1]
            prompt, answer = last_answer(chosen.input_ids, chosen.tail_len, chosen.tail_flags())
            _, other = last_answer(rejected.input_ids, rejected.tail_len, rejected.tail_flags())
            out.append(Sample(chosen.row, prompt, answer, rejected_ids=other, pair=[chosen, rejected]))
        return out
    out = []
    for i in range(min(n, len(examples))):
        e = examples[i]
        prompt, reference = last_answer(e.input_ids, e.tail_len, e.tail_flags())
        label = labels[e.label] if labels and 0 <= e.label < len(labels) else None
        out.append(Sample(e.row, prompt, reference, label))
    return out


@dataclass
class Generation:
    """What the evaluations generate and where it goes (built once by :func:`scale.training.job.setup`).

    Attributes:
        samples: the rows to complete.
        tokenizer: decodes prompts, references and completions.
        stops: token ids generation stops at (EOS and the trained end-of-turn marker).
        max_new_tokens: ``eval.max_new_tokens``.
        partitioned: the weights are sharded over ranks (ZeRO-3, FSDP): every rank generates every row.
        path: ``<output_dir>/samples.jsonl``.
        score: preference pairs: ``(model, pair) -> dict`` of the pair's logps and rewards
            (:meth:`scale.objectives.preference.PreferenceObjective.pair_scores`), added to its record; else None.
    """

    samples: list[Sample]
    tokenizer: Any
    stops: list[int]
    max_new_tokens: int
    partitioned: bool
    path: Path
    texts: dict[int, tuple[str, str]] = field(default_factory=dict)  # sample -> (prompt, reference), decoded once
    score: Callable[[torch.nn.Module, list[Any]], dict[str, Any]] | None = None

    def decoded(self, i: int) -> tuple[str, str]:
        """``(prompt, reference)`` texts of sample ``i``: the prompt with its special tokens, the reference without."""
        if i not in self.texts:
            s = self.samples[i]
            self.texts[i] = (self.tokenizer.decode(s.prompt_ids),
                             self.tokenizer.decode(s.reference_ids, skip_special_tokens=True).strip())
        return self.texts[i]


@torch.no_grad()
def generate_samples(acc: Accelerator, model: torch.nn.Module, gen: Generation,
                     stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """Greedy completions of ``gen.samples`` (module docstring), in sample order, on every rank. Collective.

    Args:
        acc: the run's Accelerator.
        model: the prepared model (DDP/DeepSpeed wrapper or not); generation runs on the unwrapped module.
        gen: the samples, tokenizer and stops.
        stop: checked before every sample on every rank; when it is true on any rank, every rank raises.

    Returns:
        One record per sample: ``row, prompt, reference, completion, exact`` (+ ``label`` for classification); a
        preference pair's: ``row, prompt, completion, chosen, rejected, exact`` + its scores (:attr:`Generation.score`).

    Raises:
        EvalInterrupted: ``stop()`` became true on some rank (the ranks agree through a one-number all-reduce
            per sample).
    """
    world, rank = acc.num_processes, acc.process_index
    order = list(range(len(gen.samples)))
    mine = order if gen.partitioned else order[rank::world]
    rounds = len(order) if gen.partitioned else math.ceil(len(order) / world)
    net = unwrap(acc, model)  # accelerate's unwrap_model outside single/DDP (DeepSpeed engine -> PeftModel)
    was_training = net.training
    net.eval()
    records = []
    def check() -> None:
        flag = torch.tensor(float(stop is not None and stop()), device=acc.device)
        if world > 1:
            flag = acc.reduce(flag, reduction="sum")  # collective: one number per sample, every rank
        if float(flag) > 0:  # host sync (generation only)
            raise EvalInterrupted("a stop was requested during generation")

    try:
        for k in range(rounds):
            check()
            if k >= len(mine):
                continue
            i = mine[k]
            records.append(_complete(acc, net, gen, i, stop))
        check()  # a stop during the last sample cut it short: not a record
        if world > 1 and not gen.partitioned:
            records = sorted(gather_object(records), key=lambda r: r["sample"])  # collective: every rank gets all
        if gen.score is not None:  # every rank scores every pair in lock-step (ZeRO-3/FSDP forwards are collective)
            for r in records:
                with acc.autocast():
                    r.update(gen.score(net, gen.samples[r["sample"]].pair))
    finally:
        if was_training:
            net.train()
    return records


class _StopRequested(StoppingCriteria):
    """Ends a generation between two tokens once ``stop()`` is true on this rank (a signal during evaluation), so a
    long sample does not hold a checkpoint back; :func:`generate_samples` then raises on every rank. Under ZeRO-3
    (``synced_gpus``) a rank that stopped keeps taking part in the others' forwards until they stop too."""

    def __init__(self, stop: Callable[[], bool]) -> None:
        self.stop = stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.stop()), dtype=torch.bool, device=input_ids.device)


def _complete(acc: Accelerator, net: torch.nn.Module, gen: Generation, i: int,
              stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    s = gen.samples[i]
    ids = torch.tensor([s.prompt_ids], dtype=torch.long, device=acc.device)
    budget = min(max(len(s.reference_ids), len(s.rejected_ids or ())), gen.max_new_tokens)
    with acc.autocast():  # the training's mixed precision (generate bypasses the prepared forward)
        out = net.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                           min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=gen.stops,
                           pad_token_id=gen.tokenizer.pad_token_id, use_cache=True,
                           synced_gpus=gen.partitioned and acc.num_processes > 1,
                           stopping_criteria=StoppingCriteriaList([_StopRequested(stop)]) if stop else None)
    new = out[0, ids.shape[1]:].tolist()  # host sync (generation only)
    completion = gen.tokenizer.decode(new, skip_special_tokens=True).strip()
    prompt, reference = gen.decoded(i)
    if s.rejected_ids is not None:  # a preference pair: the policy's answer beside chosen and rejected
        rejected = gen.tokenizer.decode(s.rejected_ids, skip_special_tokens=True).strip()
        return {"sample": i, "row": s.row, "prompt": prompt, "completion": completion, "chosen": reference,
                "rejected": rejected, "exact": completion == reference}
    record = {"sample": i, "row": s.row, "prompt": prompt, "reference": reference, "completion": completion,
              "exact": completion == reference}
    if s.label is not None:
        record["label"] = s.label
    return record


def sample_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """``eval/gen_exact_match`` (and ``eval/gen_accuracy`` with labels) over ``records``; ``{}`` when empty."""
    if not records:
        return {}
    out = {"eval/gen_exact_match": sum(r["exact"] for r in records) / len(records)}
    if all("label" in r for r in records):
        out["eval/gen_accuracy"] = sum(r["completion"] == r["label"].strip() for r in records) / len(records)
    return out | {"eval/gen_samples": len(records)}


def sample_metric_names(samples: list[Sample]) -> set[str]:
    """The ``eval/gen_*`` keys every evaluation reports when it generates ``samples`` (:func:`sample_metrics`)."""
    return set(sample_metrics([{"exact": False, "completion": "", **({"label": s.label} if s.label is not None else {})}
                               for s in samples]))


def start_samples_file(path: Path, enabled: bool, keep_until: int | None) -> None:
    """Start ``samples.jsonl`` for this attempt: empty for a fresh run; resumed from step ``keep_until``, its
    lines of steps ``<= keep_until`` (a line cut by a crash is dropped). Main process (``enabled``)."""
    if not enabled:
        return
    kept = []
    if keep_until is not None and path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= keep_until:
                    kept.append(line + "\n")
            except ValueError:
                continue
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def write_samples(acc: Accelerator, path: Path, step: int, records: list[dict[str, Any]],
                  to_trackers: bool = True, table: str = "eval/samples") -> None:
    """Append one evaluation's ``records`` to ``path`` in one write (then fsync), and log them as the W&B table
    ``table`` at ``step`` (``to_trackers``). Main process; a tracker failure costs one warning. Preference pairs'
    records (with ``chosen``) get the margin column; other records with ``rewards`` (``loss.objective: grpo``:
    held-out completions, or a round's ``train/rollouts``) get the columns
    ``step, split, row, prompt, completion, reward, advantage, rewards`` (the last as JSON)."""
    if not acc.is_main_process or not records:
        return
    text = "".join(json.dumps({"step": step, **{k: v for k, v in r.items() if k != "sample"}}) + "\n"
                   for r in records)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    if not to_trackers:
        return
    run = wandb_run(acc)
    if run is None:
        return
    try:
        import wandb

        columns = ["step", "row", "prompt", "reference", "completion", "exact"]
        if "chosen" in records[0]:  # preference pairs: the answer beside chosen and rejected, and the margin
            columns = ["step", "row", "prompt", "completion", "chosen", "rejected", "exact", "margin"]
            records = [{**r, "margin": r.get("rewards", {}).get("margin")} for r in records]
        elif "rewards" in records[0]:  # grpo: a completion, its rewards and (training) its advantage
            columns = ["step", "split", "row", "prompt", "completion", "reward", "advantage", "rewards"]
            records = [{**r, "prompt": r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"]),
                        "advantage": r.get("advantage"), "rewards": json.dumps(r["rewards"])} for r in records]
        data = wandb.Table(columns=columns, data=[[step, *(r[c] for c in columns[1:])] for r in records])
        run.log({table: data}, step=step)
    except Exception as e:  # noqa: BLE001 - a tracker must not stop training
        logger.warning("W&B: could not log the samples table (%s: %s); samples.jsonl has them", type(e).__name__, e)
