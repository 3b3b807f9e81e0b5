"""Collectives the start-up runs on every rank: a step on the main process first (:func:`main_process_first`), a
step on every rank whose outcome the ranks agree on (:func:`on_every_rank`), and a random id every rank shares
(:func:`shared_run_id`). With one process each is the plain call.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

T = TypeVar("T")


def main_process_first(acc: Accelerator, fn: Callable[[], T]) -> T:
    """``fn()`` on the main process first (it prepares the cached assets), then on the others. Collective.

    Unlike ``Accelerator.main_process_first``, an exception on the main process is raised on every rank
    (the others skip ``fn``): the ranks then fail together with the main process's message instead of
    waiting in a barrier until the launcher kills them. An exception on another rank alone (a file missing
    on one node) is marked ``rank_local`` so that the CLI prints it although that rank is not rank 0.
    """
    error: BaseException | None = None
    result: Any = None
    if acc.is_main_process:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised everywhere
            error = e
    if acc.num_processes > 1:
        box = [error]
        try:
            broadcast_object_list(box, from_process=0)  # collective
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
            box = [RuntimeError(f"{type(error).__name__}: {error}") if error is not None else None]
            broadcast_object_list(box, from_process=0)
        error = box[0]
    if error is not None:
        raise error
    if not acc.is_main_process:
        try:
            result = fn()
        except Exception as e:
            e.rank_local = True  # type: ignore[attr-defined]
            raise
    return result


def on_every_rank(acc: Accelerator, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank, then the ranks agree on the outcome (collective): an error on one rank stops all
    of them, with its message, instead of a hang in the next collective.

    Raises:
        What ``fn`` raised on this rank (``rank_local`` when rank 0 did not fail: the CLI prints it), else a
        RuntimeError when ``fn`` failed on another rank only.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised
        error = e
    if acc.num_processes == 1:
        if error is not None:
            raise error
        return result
    mine = float(error is not None)
    failed = acc.reduce(torch.tensor([mine * acc.is_main_process, mine], device=acc.device), reduction="sum")
    if error is not None:  # printed by this rank when rank 0 (whose message the CLI prints) did not fail
        error.rank_local = not acc.is_main_process and float(failed[0]) == 0  # type: ignore[attr-defined]
        raise error
    if float(failed[1]) > 0:
        raise RuntimeError("a step every rank runs failed on another rank (its message is in that rank's output)")
    return result


def shared_run_id(acc: Accelerator) -> str:
    """A random id drawn on rank 0 and broadcast (collective): the ranks of one launch share it (the token
    cache's failure marker names it, :func:`scale.data.cache.wait_for_splits`)."""
    box = [uuid.uuid4().hex]
    if acc.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return box[0]
