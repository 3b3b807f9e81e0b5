"""Test and benchmark support (never imported by ``scale/``): host reads of device values and aten ops, counted by a
``TorchDispatchMode`` per optimizer step, so that a CPU test can hold a training loop to the synchronisation budget a
GPU run needs (every read of a device value on the host stalls the CPU until the GPU has caught up).

On a CPU every tensor is a host tensor, so the mode tells a *device* value from a *host* copy by provenance: what
``Tensor.cpu()``, ``.tolist()`` or ``.numpy()`` return is a host copy (the call itself is one device-to-host read,
counted as ``copy``), and so is every tensor an op computes from host copies only; a read of a host copy is free,
as on a GPU. Reads counted:

- ``_local_scalar_dense`` (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``),
- ``nonzero`` (``t.nonzero()``, boolean-mask indexing, ``torch.where(cond)``: the output size is data-dependent),
- ``equal`` and ``is_nonzero`` (a Python bool out of a tensor),
- ``copy``: ``.cpu()`` / ``.tolist()`` / ``.numpy()`` of a tensor that is not already a host copy.

A CPU-only tensor a library keeps on the host on a GPU too (AdamW's ``step`` counters) is counted on the CPU as a
device value; compare a loop against a reference loop that shares those (benchmarks/bare_loop.py) and budget the
difference.

Beside those, ``scalars`` counts every ``_local_scalar_dense``, of a host copy too: what ``torch.profiler`` lists as
``aten::_local_scalar_dense``, the count an independent check of a GPU run starts from. :func:`marginal` turns two
runs of different lengths into reads per optimizer step, so that nothing done once (start-up, the last step's
logging, the final evaluation) is counted as a step's.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

READS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero")


class HostReads(TorchDispatchMode):
    """Counts host reads of device values and aten ops, one ``Counter`` per optimizer step (a new one starts after
    each ``Optimizer.step``): ``steps[i]['reads']``, ``steps[i]['ops']``, per kind (``'_local_scalar_dense'``,
    ``'nonzero'``, ``'copy'``, ...), and ``steps[i]['scalars']``: every ``_local_scalar_dense``, host copy or not."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[collections.Counter] = [collections.Counter()]
        self.host: dict[int, weakref.ref] = {}  # storages of host copies (and of what was computed from them only)

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self.host

    def mark_host(self, t: torch.Tensor) -> None:
        """Remember ``t``'s storage as a host copy until it is freed (a freed storage's key is reused)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.host:
            self.host[key] = weakref.ref(storage, lambda _, key=key: self.host.pop(key, None))

    def read(self, kind: str) -> None:
        self.steps[-1][kind] += 1
        self.steps[-1]["reads"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        host = bool(tensors) and all(self.is_host(t) for t in tensors)
        name = func.overloadpacket.__name__
        self.steps[-1]["ops"] += 1
        if name == "_local_scalar_dense":
            self.steps[-1]["scalars"] += 1
        if name in READS and not host:
            self.read(name)
        out = func(*args, **(kwargs or {}))
        if host:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark_host(t)
        return out

    def through(self, step: int) -> collections.Counter:
        """Every count from the start of :meth:`counting` through optimizer step ``step`` (1-based), that step's
        ``Optimizer.step`` included: what a loop did after its last step is left out."""
        if not 1 <= step < len(self.steps):
            raise ValueError(f"step {step} not counted: {len(self.steps) - 1} optimizer steps ran")
        return sum(self.steps[:step], collections.Counter())

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostReads]:
        """Enter the mode with ``Tensor.cpu/tolist/numpy`` made to count (and to return host copies), and a new
        per-step counter after every optimizer step."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        mode = self
        cpu, tolist, numpy = torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if mode.is_host(t):
                return cpu(t)
            mode.read("copy")
            with torch._C.DisableTorchFunctionSubclass():
                copy = cpu(t).clone() if t.device.type == "cpu" else cpu(t)
            mode.mark_host(copy)
            return copy

        torch.Tensor.cpu = lambda t, *a, **k: to_host(t)
        torch.Tensor.tolist = lambda t: tolist(to_host(t))
        torch.Tensor.numpy = lambda t, *a, **k: numpy(to_host(t), *a, **k)
        hook = register_optimizer_step_post_hook(lambda *_: mode.steps.append(collections.Counter()))
        try:
            with self:
                yield self
        finally:
            hook.remove()
            torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy = cpu, tolist, numpy


def marginal(short: HostReads, long: HostReads) -> dict[str, float]:
    """Counts per optimizer step of a loop, from a run of ``n`` steps (``short``) and a longer run of ``m`` steps of the
    same loop (``long``): ``(long through m - short through n) / (m - n)`` per key, so that start-up and whatever the
    last step does once (a log step, a flush) cancel out and cannot hide a per-step read.

    Raises:
        ValueError: ``long`` ran no more optimizer steps than ``short``.
    """
    n, m = len(short.steps) - 1, len(long.steps) - 1
    if m <= n:
        raise ValueError(f"the long run must run more optimizer steps than the short one: {m} vs {n}")
    a, b = short.through(n), long.through(m)
    return {k: (b[k] - a[k]) / (m - n) for k in sorted(a.keys() | b.keys())}
