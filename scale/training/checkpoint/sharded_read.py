"""Reading the sharded checkpoint of a full fine-tune (:mod:`scale.training.checkpoint.sharded` writes it): every
rank's shard memory-mapped, any range of any tensor served whatever layout wrote it (:class:`ShardReader`), and the
load into this run's live layout (:func:`load_sharded`): each rank reads only the ranges it holds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from scale.training.checkpoint.portable import SCHEDULER_FILE, _inner, _module, _prime, _set_hyper
from scale.training.checkpoint.sharded import (_SEP, SHARD_DIR, WEIGHT, ShardedStateError, _dtensor_range, _zero3_rank,
                                               reshard_fsdp, shapes_of, shard_files)


class ShardReader:
    """Every rank's shards of a checkpoint, memory-mapped (``safetensors.safe_open``): any range of any tensor,
    whatever layout wrote it. Only the slices asked for are read from disk; :meth:`close` drops the files.

    Attributes:
        shapes: ``{name: shape}`` of the trainable tensors.
        step: the optimizer's step count, or None.
        param_groups: the hyper-parameters (``lr`` as set for the next step), a list of dicts.
        world_size, mode: what wrote the checkpoint.
        whats: the optimizer-state keys present (``weight`` excluded).

    Raises:
        ShardedStateError: no shard; fewer or more shard files than the world size that wrote them (a shard
            missing, or another run's mixed in); shards that disagree on the shapes.
    """

    def __init__(self, directory: Path) -> None:
        where = directory / SHARD_DIR
        files = sorted(where.glob("shard-*-of-*.safetensors"))
        if not files:
            raise ShardedStateError(f"{where} holds no shard-*-of-*.safetensors: not a checkpoint of full weights, "
                                    f"or its shards were deleted")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._index: dict[tuple[str, str], list[tuple[int, int, Path, str]]] = {}
        metas = []
        for f, fh in self._handles.items():
            metas.append(fh.metadata() or {})
            for key in fh.keys():  # noqa: SIM118 - a safetensors file handle, not a dict
                name, what, start = key.rsplit(_SEP, 2)
                numel = fh.get_slice(key).get_shape()[0]
                self._index.setdefault((name, what), []).append((int(start), numel, f, key))
        worlds = sorted({m.get("world_size", "?") for m in metas})
        expected = {f.name for f in shard_files(directory, int(worlds[0]))} if worlds[0].isdigit() else set()
        if len(worlds) != 1 or {f.name for f in files} != expected:
            self.close()
            raise ShardedStateError(f"{where}: {len(files)} shard file(s) ({', '.join(f.name for f in files)}) "
                                    f"written by world size(s) {', '.join(worlds)}: a shard is missing or another "
                                    f"run's is mixed in")
        if len({m.get("shapes") for m in metas}) != 1:
            self.close()
            raise ShardedStateError(f"{where}: the shards describe different tensors (their 'shapes' differ): "
                                    f"another run's shard is mixed in")
        meta = metas[0]
        self.shapes = {n: tuple(s) for n, s in json.loads(meta["shapes"]).items()}
        self.step = json.loads(meta.get("step", "null"))
        self.param_groups = json.loads(meta.get("param_groups", "[]"))
        self.world_size, self.mode = int(meta["world_size"]), meta.get("mode", "")
        self.whats = sorted({w for _, w in self._index if w != WEIGHT})

    def close(self) -> None:
        self._handles.clear()

    def numel(self, name: str) -> int:
        """The number of values of tensor ``name`` (the product of its shape)."""
        return math.prod(self.shapes[name])

    def read(self, name: str, what: str, start: int, stop: int) -> torch.Tensor:
        """``[stop - start]`` float32 on CPU: values ``start .. stop`` of the flattened ``name``'s ``what``, copied
        from the pieces that overlap the range (each overlap read once, by a slice of the memory map).

        Raises:
            ShardedStateError: the shards do not cover the range (names the tensor, what, and the first value
                missing).
        """
        out = torch.empty(max(0, stop - start), dtype=torch.float32)
        covered = torch.zeros(out.numel(), dtype=torch.bool)
        for s, n, f, key in self._index.get((name, what), []):
            lo, hi = max(start, s), min(stop, s + n)
            if lo < hi:
                out[lo - start:hi - start] = self._handles[f].get_slice(key)[lo - s:hi - s]
                covered[lo - start:hi - start] = True
        if not bool(covered.all()):
            first = start + int((~covered).nonzero()[0])
            raise ShardedStateError(f"the shards cover {int(covered.sum())} of the {out.numel()} values "
                                    f"{start}..{stop} of {name} ({what}); value {first} is in none: a shard is "
                                    f"missing or belongs to another run")
        return out

    def tensor(self, name: str, what: str = WEIGHT) -> torch.Tensor:
        """The whole tensor ``name``'s ``what``, float32 on CPU, in its shape."""
        return self.read(name, what, 0, self.numel(name)).view(self.shapes[name])


# ---- loading into a live layout ----

def _set_step(inner: torch.optim.Optimizer, step: float | None) -> None:
    """Every tensor's ``step`` to the checkpoint's count (the prime step above set it to 1)."""
    if step is None:
        return
    for state in inner.state.values():
        if "step" in state:
            s = state["step"]
            if torch.is_tensor(s):
                (s.to_local() if hasattr(s, "to_local") else s).fill_(step)
            else:
                state["step"] = type(s)(step)


def _padded(reader: ShardReader, name: str, what: str, start: int, stop: int, size: int) -> torch.Tensor:
    """``[size]`` float32: values ``start .. stop`` of ``name``'s ``what``, zero-padded (ZeRO-3's partition past a
    tensor's end)."""
    out = torch.zeros(size, dtype=torch.float32)
    out[:stop - start] = reader.read(name, what, start, stop)
    return out


def load_pieces(mode: str, engine: Any, module: torch.nn.Module, inner: torch.optim.Optimizer, reader: ShardReader,
                rank: int) -> None:
    """Put the checkpoint's ranges into this rank's weights, fp32 masters and optimizer state for ``mode``'s layout:
    each rank reads only what it holds (one device and DDP every value; ZeRO-1/2 the module's weights whole, as
    ZeRO-1/2 keep them, and its fp32 fragments; ZeRO-3 and FSDP2 their partition). No collective. The optimizer's
    state is created first by :func:`_prime`, then overwritten range by range; hyper-parameters and the scheduler
    are the caller's.

    Args:
        engine: the DeepSpeed engine under ZeRO (its ``optimizer`` holds the fp32 partitions); unused otherwise.

    Raises:
        ShardedStateError: the checkpoint's tensors are not this model's (names or shapes), or a range is uncovered.
    """
    if mode == "fsdp":
        reshard_fsdp(module)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    shapes = shapes_of(module)
    if shapes != reader.shapes:
        other = sorted(n for n in set(shapes) | set(reader.shapes) if shapes.get(n) != reader.shapes.get(n))
        raise ShardedStateError(f"the checkpoint holds other tensors than this model trains: {other[:3]} differ "
                                f"(missing, unexpected or of another shape)")
    keys = reader.whats
    if mode.startswith("zero"):  # ZeRO: the state lives on the fp32 partitions, created by a step of lr 0
        zero = engine.optimizer
        partitions = (getattr(zero, "fp32_partitioned_groups_flat", None)
                      or getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_groups_flat_partition)
        if keys:
            own = inner.param_groups
            inner.param_groups = [{**own[0], "params": list(partitions)}]
            try:
                _prime(inner, list(partitions))
            finally:
                inner.param_groups = own
            if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # link each fragment to its state
                zero._lazy_init_hp_params_optimizer_state()
    elif keys:
        _prime(inner, [p for _, p in named])
    _set_step(inner, reader.step)
    with torch.no_grad():
        for name, p in named:
            numel = reader.numel(name)
            if mode == "zero3":
                from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

                part = p.ds_tensor.numel()
                a = min(numel, _zero3_rank(p, rank) * part)
                b = min(numel, a + part)

                weight = _padded(reader, name, WEIGHT, a, b, part).to(p.ds_tensor.device)
                safe_set_local_fp32_param(p, weight)
                p.ds_tensor.data.copy_(weight.to(p.ds_tensor.dtype))  # the module's partition: the master, cast
                for key in keys:
                    safe_set_local_optimizer_state(p, _padded(reader, name, key, a, b, part).to(weight.device), key)
            elif mode in ("zero1", "zero2"):
                full = reader.read(name, WEIGHT, 0, numel)
                p.data.copy_(full.view(p.shape).to(p.device, p.dtype))  # ZeRO-1/2 keep the module whole
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is not None:
                    a = mapping.lp_fragment_address.start
                    b = a + mapping.lp_fragment_address.numel
                    master = mapping.get_hp_fragment()
                    master.data.copy_(full[a:b].view(master.shape).to(master.device))
                    for key in keys:
                        frag = mapping.get_hp_fragment(key)
                        frag.data.copy_(reader.read(name, key, a, b).view(frag.shape).to(frag.device))
            elif mode == "fsdp":
                start, local = _dtensor_range(p.data)
                local.copy_(reader.read(name, WEIGHT, start, start + local.numel()))
                for key in keys:
                    s, values = _dtensor_range(inner.state[p][key])
                    values.copy_(reader.read(name, key, s, s + values.numel()))
            else:
                p.copy_(reader.read(name, WEIGHT, 0, numel).view(p.shape).to(p.device, p.dtype))
                for key in keys:
                    state = inner.state[p][key]
                    state.copy_(reader.read(name, key, 0, numel).view(state.shape).to(state.device))


# ---- a run's checkpoint: what the saver and the loader call ----

def load_sharded(acc: Any, plan: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any, directory: Path) -> None:
    """Put a full fine-tune's checkpoint into this run's weights, fp32 masters, optimizer state, hyper-parameters and
    LR scheduler, in any launch mode on any number of processes (:func:`load_pieces`). Not collective; the RNG
    states are :func:`scale.training.checkpoint.portable.restore_rng`'s.

    Raises:
        ShardedStateError: the shards do not describe this model, or leave a range uncovered (names the tensor).
    """
    module, inner = _module(acc, plan, model), _inner(optimizer)
    reader = ShardReader(directory)
    try:
        load_pieces(plan.mode, model, module, inner, reader, acc.process_index)
        _set_hyper(inner, reader.param_groups)
    finally:
        reader.close()
    scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))
