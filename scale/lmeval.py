"""``scale-lm-eval``: the run's held-out split as a local lm-evaluation-harness task, evaluated on ``merged/``.

    scale-export runs/default && scale-lm-eval runs/default       # writes runs/default/lm_eval/, prints the figures
    scale-lm-eval runs/sft --tasks hellaswag --batch-size 8       # the run's task plus harness tasks (hub data)
    scale-lm-eval runs/default --write-only                       # only the task; it prints the lm_eval command

Needs the ``eval`` extra (``pip install -e '.[eval]'``: lm-eval with its ``hf`` backend). No hub: the task reads
``<run>/lm_eval/<task>.jsonl``, written here from the eval split the run evaluated (the same rows, order and
tokens: the config's token cache, :func:`scale.data.cache.load_splits`), one document per row:

- labels (``data.labels``): a ``multiple_choice`` task, ``acc``: the label with the highest summed
  log-likelihood after the prompt. It reproduces ``eval/accuracy``: the same ranking (single-token labels by the
  label token, longer ones with their EOS, as :class:`scale.data.tasks.classification.Classification` scores them);
- completions and chats: a ``generate_until`` task, ``exact_match``: greedy, stopping at the trained end-of-turn
  marker. It reproduces ``eval/gen_exact_match`` on every eval row (the run generates ``eval.generate_samples``).

A document's context is the row's trained prompt decoded with its special tokens (the chat template already
applied, as in ``samples.jsonl``), so the harness scores the text the run scored; it re-tokenizes it without
adding special tokens (``add_bos_token=False``: the prompt holds any BOS it trained with). Documents whose text
does not re-tokenize to the run's tokens (a prompt truncated inside a word, a special-token spelling the run
encoded as text) are counted in the log and in ``results.json``. Plain-text runs (no label, no completion) have
no held-out answer to score: refused.

``results.json`` holds the harness's figures next to the run's last evaluation (``metrics.jsonl``). No accelerate
import here (the harness's ``hf`` model imports it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scale.config.help import help_text
from scale.config.load import load_config
from scale.data import tasks
from scale.data.cache import load_splits
from scale.data.read import DataError
from scale.generation.export import serving_tokenizer
from scale.modeling.build import load_tokenizer
from scale.training.samples import pick_samples
from scale.utils.assets import resolve_data
from scale.utils.fileio import write_text_atomic
from scale.utils.logs import configure_logging

logger = logging.getLogger(__name__)

TASK_DIR = "lm_eval"
EXIT_BAD_INPUT = 2


class LmEvalError(ValueError):
    """A run the harness task cannot be written for, or a missing piece: one line naming the fix."""


@dataclass
class TaskFiles:
    """A written task.

    Attributes:
        name: the task name (``scale_<run directory name>``).
        directory: the ``--include_path`` holding ``<name>.yaml`` and ``<name>.jsonl``.
        kind: ``multiple_choice`` or ``generate_until``.
        docs: how many documents (eval rows).
        mismatched: documents whose text does not re-tokenize to the run's tokens.
        run_metric: the run's figure the harness's reproduces (``eval/accuracy``, ``eval/gen_exact_match``).
        harness_metric: the harness's metric name (``acc``, ``exact_match``).
    """

    name: str
    directory: Path
    kind: str
    docs: int
    mismatched: int
    run_metric: str
    harness_metric: str


def task_name(run_dir: Path) -> str:
    """``scale_<run directory name>`` in the characters a harness task name may hold."""
    return "scale_" + (re.sub(r"[^A-Za-z0-9_]+", "_", run_dir.resolve().name).strip("_") or "run")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _docs(run_dir: Path) -> tuple[list[dict[str, Any]], str, list[str], int]:
    """``(documents, kind, stop texts, mismatched)`` from the run's eval split.

    Raises:
        LmEvalError: the run has no ``config.yaml``, or its rows have no held-out answer (plain text).
    """

    if not (run_dir / "config.yaml").is_file():
        raise LmEvalError(f"{run_dir} has no config.yaml: give the directory of a trained run")
    cfg = load_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(cfg.model)
    path = cfg.data.path if cfg.data.datasets else resolve_data(cfg.data.path)
    splits = load_splits(cfg, tokenizer, path)
    if tasks.get(splits.format).uses_threshold:
        raise LmEvalError(f"{run_dir}: data.format={splits.format} rows have no held-out answer to score (no label, "
                          f"no completion); the harness task needs labels, completions or chats")
    samples = pick_samples(splits.eval, len(splits.eval), cfg.data.labels)
    _, stops, _ = serving_tokenizer(cfg, run_dir)
    docs, mismatched = [], 0
    if splits.label_seqs:  # ranked labels: the choices are the label tokens (+ EOS when some label is longer)
        with_eos = any(len(s) > 1 for s in splits.label_seqs)
        seqs = [s + [tokenizer.eos_token_id] if with_eos else s for s in splits.label_seqs]
        choices = [tokenizer.decode(s) for s in seqs]
        for i, s in enumerate(samples):
            context, gold = tokenizer.decode(s.prompt_ids), int(splits.eval[i].label)
            docs.append({"row": s.row, "context": context, "choices": choices, "gold": gold})
            mismatched += _encode(tokenizer, context) != s.prompt_ids or any(
                _encode(tokenizer, context + c) != s.prompt_ids + q for c, q in zip(choices, seqs))
        return docs, "multiple_choice", [], mismatched
    for s in samples:
        context = tokenizer.decode(s.prompt_ids)
        reference = tokenizer.decode(s.reference_ids, skip_special_tokens=True).strip()
        docs.append({"row": s.row, "context": context, "reference": reference})
        mismatched += _encode(tokenizer, context) != s.prompt_ids
    return docs, "generate_until", [tokenizer.decode([t]) for t in stops], mismatched


def task_yaml(name: str, data: Path, kind: str, stops: list[str], max_new_tokens: int) -> str:
    """The harness's task config (YAML, written as JSON, which YAML reads) for the documents in ``data``."""
    config: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": kind,
        "doc_to_text": "context",
        "target_delimiter": "",   # the context ends where the run's prompt ends; the answer follows it directly
        "num_fewshot": 0,
        "metadata": {"version": 1.0},
    }
    if kind == "multiple_choice":
        config.update(doc_to_choice="choices", doc_to_target="gold",
                      metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}])
    else:
        config.update(doc_to_target="reference",
                      generation_kwargs={"until": stops, "do_sample": False, "max_gen_toks": max_new_tokens},
                      metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                                    "regexes_to_ignore": [r"^\s+", r"\s+$"]}])   # both texts stripped, as the run
    return json.dumps(config, indent=2) + "\n"


def write_task(run_dir: str | Path, out: str | Path | None = None) -> TaskFiles:
    """Write ``<out>/<name>.jsonl`` (one document per eval row) and ``<out>/<name>.yaml`` (default ``out``:
    ``<run_dir>/lm_eval``), atomically.

    Raises:
        LmEvalError: see :func:`_docs`.
        DataError: the run's data no longer loads (see :func:`scale.data.tokenize.build_splits`).
    """
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / TASK_DIR
    docs, kind, stops, mismatched = _docs(run_dir)  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    name = task_name(run_dir)
    data = out / f"{name}.jsonl"
    write_text_atomic(data, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    write_text_atomic(out / f"{name}.yaml", task_yaml(name, data, kind, stops,
                                                      load_config(run_dir / "config.yaml").eval.max_new_tokens))
    if mismatched:
        logger.warning("%d of %d documents do not re-tokenize to the tokens the run evaluated (a prompt truncated "
                       "inside a word, a special-token spelling the run encoded as text): the harness's figure can "
                       "differ from the run's on those", mismatched, len(docs))
    run_metric, harness_metric = ("eval/accuracy", "acc") if kind == "multiple_choice" else \
        ("eval/gen_exact_match", "exact_match")
    return TaskFiles(name, out, kind, len(docs), mismatched, run_metric, harness_metric)


def model_args(model_dir: Path) -> dict[str, Any]:
    """The harness's ``hf`` model arguments for ``model_dir``: its own dtype, no special tokens added."""
    return {"pretrained": str(model_dir), "add_bos_token": False, "dtype": "auto"}


def lm_eval_command(task: TaskFiles, model_dir: Path, batch_size: int) -> str:
    """The ``lm_eval`` command line equivalent to :func:`evaluate` (printed by ``--write-only``)."""
    args = ",".join(f"{k}={v}" for k, v in model_args(model_dir).items())
    return (f"lm_eval --model hf --model_args {args} --include_path {task.directory} --tasks {task.name} "
            f"--batch_size {batch_size} --device cpu")


def last_eval(run_dir: Path) -> dict[str, Any]:
    """The run's last ``metrics.jsonl`` record with ``eval/*`` figures (``{}`` when there is none)."""
    path = run_dir / "metrics.jsonl"
    found: dict[str, Any] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line) if line.strip() else {}
            if any(k.startswith("eval/") for k in record):
                found = record
    return found


def default_model_dir(run_dir: Path) -> Path:
    """The directory the harness loads when none is given: ``<run_dir>/merged`` (scale-export's LoRA merge), or
    ``<run_dir>/model`` for a ``model.finetune=full`` run (already a plain transformers directory)."""
    config = run_dir / "config.yaml"
    full = config.is_file() and load_config(config).model.finetune == "full"
    return run_dir / ("model" if full else "merged")


def evaluate(run_dir: str | Path, model_dir: str | Path | None = None, extra_tasks: list[str] | None = None,
             batch_size: int = 8, limit: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Write the run's task and evaluate ``model_dir`` (default :func:`default_model_dir`) on it (and ``extra_tasks``)
    with ``lm_eval.simple_evaluate``; write ``<run_dir>/lm_eval/results.json``.

    Args:
        run_dir: a trained run (``config.yaml``, ``metrics.jsonl``).
        model_dir: the model directory the harness loads (``hf`` backend).
        extra_tasks: harness tasks to run as well (their data may need the hub).
        batch_size: documents per forward.
        limit: documents per task (``None``: all).
        device: the harness's device (``cpu``, ``cuda``, ``cuda:0``).

    Returns:
        ``{"task", "results" (per task: the harness's figures), "docs", "mismatched", "run" (the run's last
        evaluation: step and the figure the task reproduces), "samples" (per task: the harness's per-document
        records, not written to results.json)}``.

    Raises:
        LmEvalError: no model directory, lm-eval not installed, or see :func:`write_task`.
    """
    run_dir = Path(run_dir)
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir(run_dir)
    if not (model_dir / "config.json").is_file():
        raise LmEvalError(f"{model_dir} is not a model directory: run `scale-export {run_dir}` first (or pass "
                          f"--model DIR)")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise LmEvalError("lm-eval is not installed: pip install -e '.[eval]' (lm-eval with its hf backend)") \
            from None
    task = write_task(run_dir)
    manager = TaskManager(include_path=str(task.directory), include_defaults=bool(extra_tasks))
    out = lm_eval.simple_evaluate(model="hf", model_args=model_args(model_dir), tasks=[task.name, *(extra_tasks or [])],
                                  batch_size=batch_size, device=device, limit=limit, task_manager=manager,
                                  log_samples=True, num_fewshot=None)
    results = {name: {k: v for k, v in figures.items() if k != "alias"} for name, figures in out["results"].items()}
    run = last_eval(run_dir)
    summary = {"task": task.name, "model": str(model_dir), "kind": task.kind, "docs": task.docs,
               "mismatched": task.mismatched, "results": results,
               "run": {"step": run.get("step"), task.run_metric: run.get(task.run_metric)},
               "compare": {"harness": f"{task.harness_metric},none", "run": task.run_metric}}
    write_text_atomic(task.directory / "results.json", json.dumps(summary, indent=2, default=str) + "\n")
    return {**summary, "samples": out.get("samples", {})}


def main(argv: list[str] | None = None) -> int:
    """``scale-lm-eval RUN_DIR [--model DIR] [--tasks T,...] [--batch-size N] [--limit N] [--write-only]``."""
    parser = argparse.ArgumentParser(prog="scale-lm-eval", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a trained run (config.yaml, metrics.jsonl; merged/ from scale-export)")
    parser.add_argument("--model", default=None, help="the model directory to evaluate (default: RUN_DIR/merged; "
                                                      "RUN_DIR/model for a model.finetune=full run)")
    parser.add_argument("--tasks", default="", help="harness tasks to run as well, comma-separated (their data may "
                                                    "need the hub)")
    parser.add_argument("--batch-size", type=int, default=8, help="documents per forward")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0, ...")
    parser.add_argument("--write-only", action="store_true", help="write the task and print the lm_eval command")
    args = parser.parse_args(argv)
    configure_logging(dict(os.environ))  # scale-train's line format and third-party notice handling
    run_dir = Path(args.run_dir)
    model_dir = Path(args.model) if args.model else default_model_dir(run_dir)

    try:
        if args.write_only:
            task = write_task(run_dir)
            sys.stdout.write(f"{task.directory / (task.name + '.yaml')}: {task.docs} documents ({task.kind})\n"
                             f"{lm_eval_command(task, model_dir, args.batch_size)}\n")
            return 0
        summary = evaluate(run_dir, model_dir, [t for t in args.tasks.split(",") if t], args.batch_size,
                           args.limit, args.device)
    except (LmEvalError, DataError) as e:
        sys.stderr.write(f"scale-lm-eval: error: {e}\n")
        return EXIT_BAD_INPUT
    harness, run_key = summary["compare"]["harness"], summary["compare"]["run"]
    for name, figures in summary["results"].items():
        shown = " ".join(f"{k}={v:.4f}" for k, v in figures.items() if isinstance(v, float))
        sys.stdout.write(f"{name}: {shown}\n")
    ours = summary["results"][summary["task"]].get(harness)
    sys.stdout.write(f"{summary['task']}: lm-eval {harness.split(',')[0]}={ours} over {summary['docs']} documents; "
                     f"the run's {run_key} at step {summary['run']['step']}: {summary['run'][run_key]}; written "
                     f"to {run_dir / TASK_DIR / 'results.json'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
