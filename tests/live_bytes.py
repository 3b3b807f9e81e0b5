"""Test and benchmark support (never imported by ``scale/``): the bytes of live tensor storages, counted by a
``TorchDispatchMode`` — the measured side of the planner's checks (tests/test_plan.py) and of the memory benchmarks
(benchmarks/loss_memory.py, benchmarks/sp_memory.py)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive: those registered at the start (``before``: a view of a weight, such as
    the head's transpose, is then not counted as new) plus every storage an op creates inside the mode, each
    forgotten when it is freed; ``peak`` is the most at once (what ``max_memory_allocated`` would report on a GPU,
    without the allocator's rounding). Works on fake tensors too (``FakeTensorMode``: shapes, no memory)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.now, self.peak, self.refs = 0, 0, {}
        for t in existing:
            self.add(t)
        self.before = self.now

    def add(self, t) -> None:
        """Count ``t``'s storage once, until it is freed; anything that is not a tensor is ignored."""
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self.refs or not nbytes:
            return
        self.now += nbytes
        self.peak = max(self.peak, self.now)

        def freed(_, key=key, nbytes=nbytes) -> None:
            self.now -= nbytes
            self.refs.pop(key, None)

        self.refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.add(t)
        return out
