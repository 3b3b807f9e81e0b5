"""Reward functions for ``loss.objective: grpo`` (``rl.rewards``), with TRL's signature, so a function written for
TRL's ``GRPOTrainer`` runs unchanged. Plain Python and torch, no accelerate.

    rl:
      rewards:
        - my_rewards:exact_answer                          # module:function (or path/to/file.py:function), weight 1
        - {fn: exact_match, column: label, part: first_word, weight: 1.0}   # a built-in (BUILTINS)
        - {fn: regex, pattern: '^ (positive|negative)\\n', weight: 0.2}
        - {model: runs/rm/merged, weight: 0.5}             # a local sequence-classification model directory

A function is called once per round on this rank's completions as
``fn(prompts=[...], completions=[...], completion_ids=[[...]], <column>=[...] for every other column of the rows,
trainer_state=..., log_extra=..., log_metric=...)`` and returns one number per completion (TRL 1.16
``GRPOTrainer._calculate_rewards``): ``prompts`` and ``completions`` are text, or lists of messages for a
conversational prompt (the completion then ``[{"role": "assistant", "content": text}]``), ``completion_ids`` the
sampled tokens (its stop token included). ``None`` means "does not apply to this completion" (left out of the
advantages' sums, as TRL does); a completion no function scored gets advantage 0. A reward model scores
``prompt + completion`` (rendered by its tokenizer's chat template for messages), its first logit, as TRL does.

A function that raises, returns the wrong number of values, or a value that is not a finite number (or ``None``)
stops the run with one line naming the function and the data-file row (:class:`RewardError`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RewardFn = Callable[..., Sequence[Any]]


class RewardError(ValueError):
    """A reward function failed (raised, wrong length, a value that is not a finite number): one line naming it and
    the data-file row. Also the error for an ``rl.rewards`` entry that cannot be built."""


def completion_text(completion: Any) -> str:
    """The text of a completion as reward functions get it: the string, or the content of its assistant message."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def _part(text: str, part: str) -> str:
    text = text.strip()
    if part == "first_word":  # without the punctuation around it: " Positive." -> "Positive"
        return text.split()[0].strip(string.punctuation) if text.split() else ""
    if part == "first_line":
        return text.splitlines()[0].strip() if text else ""
    return text


class ExactMatch:
    """Built-in ``exact_match``: 1.0 when the completion equals the row's ``column`` (both stripped; ``part``:
    ``all`` the whole completion, ``first_word`` (without the punctuation around it) or ``first_line`` only that;
    ``ignore_case``), else 0.0.

    Args:
        column: the data column holding the answer.
        part: ``all`` | ``first_word`` | ``first_line``.
        ignore_case: compare case-folded.
    """

    PARTS = ("all", "first_word", "first_line")

    def __init__(self, column: str = "answer", part: str = "all", ignore_case: bool = False) -> None:
        if part not in self.PARTS:
            raise RewardError(f"rl.rewards: exact_match part={part!r} is not one of {list(self.PARTS)}")
        self.column, self.part, self.ignore_case = column, part, ignore_case
        self.__name__ = "exact_match"

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float]:
        if self.column not in kwargs:
            raise RewardError(f"exact_match: the rows have no column {self.column!r} (columns: "
                              f"{sorted(k for k in kwargs if k not in TRL_EXTRAS + ('prompts', 'completion_ids'))}); set its "
                              f"column")
        out = []
        for c, answer in zip(completions, kwargs[self.column]):
            got, want = _part(completion_text(c), self.part), str(answer).strip()
            if self.ignore_case:
                got, want = got.casefold(), want.casefold()
            out.append(float(got == want))
        return out


class Regex:
    """Built-in ``regex``: 1.0 when the completion text matches ``pattern`` (``re.fullmatch``, or ``re.search``
    with ``search: true``; ``re.DOTALL``), else 0.0: a format reward."""

    def __init__(self, pattern: str, search: bool = False) -> None:
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise RewardError(f"rl.rewards: regex pattern {pattern!r} does not compile: {e}") from None
        self.search = search
        self.__name__ = "regex"

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float]:
        match = self.pattern.search if self.search else self.pattern.fullmatch
        return [float(match(completion_text(c)) is not None) for c in completions]


class SoftOverlong:
    """Built-in ``length``: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13, arXiv:2503.14476; TRL's
    ``get_soft_overlong_punishment``): 0 up to ``max_length - cache`` tokens, then falling linearly to -1 at
    ``max_length``, -1 beyond. ``max_length`` defaults to ``rl.max_completion_length``."""

    def __init__(self, max_length: int, cache: int = 0) -> None:
        if not 0 <= cache <= max_length:
            raise RewardError(f"rl.rewards: length needs 0 <= cache ({cache}) <= max_length ({max_length})")
        self.max_length, self.cache = max_length, cache
        self.__name__ = "length"

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        out = []
        for ids in completion_ids:
            n, start = len(ids), self.max_length - self.cache
            out.append(0.0 if n <= start else (start - n) / self.cache if n <= self.max_length else -1.0)
        return out


class RewardModel:
    """A local sequence-classification model directory as a reward (TRL's convention): the first logit of
    ``prompt + completion`` (text), or of the conversation rendered by the model's tokenizer's chat template.

    Args:
        path: the directory (``config.json``, weights, tokenizer files).
        device: where the model runs.

    Raises:
        RewardError: the directory is missing or holds no sequence-classification model.
    """

    def __init__(self, path: str, device: Any = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not Path(path).is_dir():
            raise RewardError(f"rl.rewards: model={path!r} is not a directory; give a local sequence-classification "
                              f"model directory (config.json, weights, tokenizer)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        except (OSError, ValueError, KeyError) as e:
            raise RewardError(f"rl.rewards: model={path!r} cannot be loaded as a sequence-classification model "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.__name__ = Path(path).name

    @torch.inference_mode()
    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        if prompts and isinstance(prompts[0], list):
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                             add_special_tokens=False).to(self.device)
        return self.model(**enc).logits[:, 0].float().tolist()


TRL_EXTRAS = ("trainer_state", "log_extra", "log_metric")
"""The keywords TRL passes every reward function besides the rows' columns."""
BUILTINS: dict[str, Callable[..., RewardFn]] = {"exact_match": ExactMatch, "regex": Regex, "length": SoftOverlong}


def import_function(path: str, key: str = "rl.rewards") -> RewardFn:
    """``module:function`` (importable, or from the current directory) or ``path/to/file.py:function``.

    Raises:
        RewardError: malformed, does not import, no such function, or not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"{key}: {path!r} is not 'module:function' (or 'path/to/file.py:function', or a built-in: "
                          f"{', '.join(BUILTINS)})")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if e.name != module_name.split(".")[0] or "" in sys.path:
                    raise
                sys.path.insert(0, "")  # `python -m` puts the working directory first; a console script does not
                module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except Exception as e:  # noqa: BLE001 - any failure to import is the user's module: one line
        raise RewardError(f"{key}: {path!r} does not import ({type(e).__name__}: {e}); check the module path "
                          f"(run from the directory holding it, or give path/to/file.py:function)") from None
    if not callable(fn):
        raise RewardError(f"{key}: {path!r} is not callable")
    return fn


@dataclass
class Reward:
    """One entry of ``rl.rewards``, built.

    Attributes:
        name: what metrics call it (``reward/<name>``): the function's ``__name__``, a built-in's name, a reward
            model's directory name; a repeated name gets ``_2``, ``_3``.
        fn: the TRL-signature callable.
        weight: its weight in the total reward.
        key: ``rl.rewards[i]``, for messages.
    """

    name: str
    fn: RewardFn
    weight: float = 1.0
    key: str = "rl.rewards[0]"


def build_rewards(entries: list[Any], max_completion_length: int, device: Any = "cpu") -> list[Reward]:
    """Build ``rl.rewards``: each entry a string (a path or a built-in's name) or a mapping with ``fn`` or
    ``model``, an optional ``weight`` and a built-in's parameters.

    Raises:
        RewardError: an entry that cannot be built (one line naming ``rl.rewards[i]`` and the fix).
    """
    if not entries:
        raise RewardError("rl.rewards is empty: loss.objective=grpo needs at least one reward function "
                          "(e.g. rl.rewards=[{fn: exact_match, column: answer}])")
    out: list[Reward] = []
    for i, entry in enumerate(entries):
        key = f"rl.rewards[{i}]"
        spec = {"fn": entry} if isinstance(entry, str) else dict(entry) if isinstance(entry, dict) else None
        if spec is None:
            raise RewardError(f"{key}: {entry!r} is neither 'module:function' nor a mapping with fn or model")
        weight = spec.pop("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight):
            raise RewardError(f"{key}: weight={weight!r} is not a finite number")
        fn_name, model = spec.pop("fn", None), spec.pop("model", None)
        if (fn_name is None) == (model is None):
            raise RewardError(f"{key}: give exactly one of fn ('module:function' or a built-in) and model (a reward "
                              f"model directory)")
        if model is not None:
            if spec:
                raise RewardError(f"{key}: a reward model takes no {sorted(spec)}")
            fn: RewardFn = RewardModel(str(model), device)
        elif fn_name in BUILTINS:
            if fn_name == "length":
                spec.setdefault("max_length", max_completion_length)
            try:
                fn = BUILTINS[fn_name](**spec)
            except TypeError as e:
                raise RewardError(f"{key}: built-in {fn_name}: {e}") from None
            except RewardError as e:
                raise RewardError(str(e).replace("rl.rewards", key, 1)) from None
        else:
            if spec:
                raise RewardError(f"{key}: {fn_name} is not a built-in ({', '.join(BUILTINS)}), so it takes no "
                                  f"{sorted(spec)}; a function of yours reads its parameters itself")
            fn = import_function(str(fn_name), key)
        name = str(getattr(fn, "__name__", None) or type(fn).__name__)
        taken = {r.name for r in out}
        base, k = name, 2
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        out.append(Reward(name, fn, float(weight), key))
    return out


def _value(v: Any) -> float | None:
    """A reward function's value as a float, ``None`` kept; raises ``TypeError`` for anything else."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (str, bytes)):
        raise TypeError(f"{type(v).__name__} {v!r}")
    try:
        return float(v)  # int, float, numpy scalars
    except (TypeError, ValueError):
        raise TypeError(f"{type(v).__name__} {v!r}") from None


@dataclass
class RewardCall:
    """What one round hands the reward functions on this rank (TRL's keywords).

    Attributes:
        prompts: one per completion (text or messages), a prompt repeated for each of its completions.
        completions: one per completion (text, or ``[{"role": "assistant", "content": text}]``).
        completion_ids: the sampled tokens of each.
        columns: every other column of the rows, one value per completion.
        rows: each completion's data-file row (for messages).
        extras: ``trainer_state``, ``log_extra``, ``log_metric``.
    """

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)

    def kwargs(self, keep: list[int] | None = None) -> dict[str, Any]:
        """The keywords of the call (only completions ``keep``, when given)."""
        pick = (lambda xs: [xs[i] for i in keep]) if keep is not None else (lambda xs: list(xs))
        return {"prompts": pick(self.prompts), "completions": pick(self.completions),
                "completion_ids": pick(self.completion_ids), **{k: pick(v) for k, v in self.columns.items()},
                **self.extras}


def _row_text(call: RewardCall, i: int) -> str:
    return f"data-file row {call.rows[i]}" if i < len(call.rows) and call.rows[i] >= 0 else f"completion {i}"


def score(rewards: list[Reward], call: RewardCall) -> torch.Tensor:
    """Every reward function on this rank's completions.

    Returns:
        ``[N, F]`` float32 (TRL's dtype): the unweighted value of function ``f`` on completion ``i``, NaN for
        ``None``.

    Raises:
        RewardError: a function raised (the first row it raises on alone is named, when one does), returned a
            number of values other than ``N``, or a value that is neither a finite number nor ``None``.
    """
    n = len(call.completions)
    out = torch.empty((n, len(rewards)), dtype=torch.float32)
    for f, r in enumerate(rewards):
        try:
            values = list(r.fn(**call.kwargs()))
        except RewardError as e:
            raise RewardError(f"{r.key} ({r.name}): {e}") from None
        except Exception as e:  # noqa: BLE001 - the user's function: name it and the row, in one line
            where = ""
            for i in range(n):  # the error path only: find the first row that fails alone
                try:
                    r.fn(**call.kwargs([i]))
                except Exception:  # noqa: BLE001
                    where = f" on the completion of {_row_text(call, i)}"
                    break
            msg = str(e).splitlines()[0] if str(e) else ""
            raise RewardError(f"{r.key} ({r.name}) raised {type(e).__name__}: {msg}{where}; fix the function or "
                              f"the row") from None
        if len(values) != n:
            raise RewardError(f"{r.key} ({r.name}) returned {len(values)} values for {n} completions; a reward "
                              f"function returns one number (or None) per completion")
        for i, v in enumerate(values):
            try:
                x = _value(v)
            except TypeError as e:
                raise RewardError(f"{r.key} ({r.name}) returned {e} for the completion of {_row_text(call, i)}; "
                                  f"return a number (or None: does not apply)") from None
            if x is not None and not math.isfinite(x):
                raise RewardError(f"{r.key} ({r.name}) returned {x} for the completion of {_row_text(call, i)}; "
                                  f"rewards must be finite (None: does not apply)")
            out[i, f] = math.nan if x is None else x
    return out


def total(per_func: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """``[N]`` the weighted sum over functions, NaN where no function scored the completion (TRL's
    ``sum_then_normalize``: ``nansum``, then NaN for an all-``None`` row)."""
    w = torch.tensor(weights, dtype=per_func.dtype, device=per_func.device)
    out = (per_func * w[None]).nansum(dim=1)
    return out.masked_fill(torch.isnan(per_func).all(dim=1), math.nan)
