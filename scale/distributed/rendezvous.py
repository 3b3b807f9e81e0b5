"""Starting the process group so that restarts recover: bounded, retried tries on keys of their own.

torchrun ``--max-restarts`` restarts a worker group after a failure; the new group must meet in the rendezvous store
the old one used. :func:`init_elastic_process_group` keeps each restart (and each try) to its own keys,
:func:`with_rendezvous_retries` tries again when the meeting fails on the network.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch

T = TypeVar("T")


_RENDEZVOUS_FAILURES = ("Connection refused", "Connection reset", "Connection closed", "Broken pipe",
                        "Socket Timeout", "timed out", "Timed out", "DistNetworkError", "DistStoreError",
                        "failed to recv", "failed to send")


def is_rendezvous_failure(error: BaseException) -> bool:
    """Whether ``error`` (raised while the process group starts) is a network failure worth another try:
    torch's ``DistNetworkError``/``DistStoreError``, or gloo's connection errors (refused, reset, timed out)."""
    dist_errors = tuple(getattr(torch.distributed, n) for n in ("DistNetworkError", "DistStoreError")
                        if hasattr(torch.distributed, n))
    text = f"{type(error).__name__}: {error}"
    return isinstance(error, dist_errors) or (isinstance(error, RuntimeError)
                                              and any(s in text for s in _RENDEZVOUS_FAILURES))


def with_rendezvous_retries(make: Callable[[], T], retries: int, backoff_s: float = 2.0,
                            sleep: Callable[[float], None] | None = None) -> T:
    """``make()`` (which starts the process group), tried again up to ``retries`` times with exponential backoff
    (``backoff_s``, 2x, 4x... seconds) when the rendezvous fails on the network (:func:`is_rendezvous_failure`).

    After a torchrun ``--max-restarts`` restart the new workers' gloo rendezvous was sometimes refused (3 of 12
    elastic trials spent all their restarts on it): a restart of the whole worker group costs tens of seconds
    and one of the few restarts, a retry here costs the backoff. Between tries the half-made process group and
    accelerate's shared state are discarded.

    Raises:
        The last failure once ``retries`` are spent; any other error at once.
    """
    sleep = sleep or time.sleep
    for attempt in range(retries + 1):
        try:
            return make()
        except Exception as e:  # only rendezvous failures are retried
            if attempt == retries or not is_rendezvous_failure(e):
                raise
            wait = backoff_s * 2**attempt
            logging.getLogger(__name__).warning("process group rendezvous failed (%s: %s); retry %d of %d in "
                                                "%.0f s", type(e).__name__, str(e)[:200], attempt + 1, retries, wait)
            reset_process_group()
            sleep(wait)
    raise AssertionError("unreachable")


def init_elastic_process_group(attempt: int, timeout: timedelta) -> bool:
    """After a torch elastic restart (or a failed try), start the default process group on rendezvous-store keys of
    its own for this restart and try; return whether it did (a first start is left to accelerate).

    torchrun (c10d rendezvous, ``TORCHELASTIC_USE_AGENT_STORE=True``) hands every worker group the agent's store,
    and ``init_process_group(env://)`` reuses it without a per-restart prefix ("a new TCPStore for every retry",
    torch/distributed/rendezvous.py): after a restart, the new rank 0 was seen connecting to the port of the killed
    group's rank 1 (gloo "Connection refused, remote=127.0.0.1:3502", the very port the old group's "Connection
    reset by peer" named), an address the old group left in the store. A prefix made of
    ``TORCHELASTIC_RESTART_COUNT`` and the try keeps each group to its own addresses. Gloo on CPU, NCCL on CUDA.
    """
    env = os.environ
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return False
    if restart == "0" and attempt == 0:  # a first start (every `accelerate launch`): no old keys, accelerate's way
        return False
    store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                       timeout=timeout)
    prefix = f"scale/restart_{restart}/try_{attempt}"
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                         store=torch.distributed.PrefixStore(prefix, store),
                                         rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), timeout=timeout)
    return True


def reset_process_group() -> None:
    """Forget a half-made process group and accelerate's shared state, so that the next ``Accelerator()``
    starts them again."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()
