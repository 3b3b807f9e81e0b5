"""Count what one rank really holds, for ``tests/test_plan.py``: run under ``accelerate launch`` (or plain python).

    accelerate launch --config_file configs/accelerate/cpu_zero2.yaml tests/plan_census.py OUT.json \\
        --config configs/train/tiny_cpu.yaml [key=value ...] [--case NAME key=value ...]...

Builds the job's model as the harness does (``scale.modeling.build.build_model``; for a ``model.name_or_path`` directory
that holds only a ``config.json``, random weights from that config through the same ``add_lora``), prepares it with the harness's
Accelerator and optimizer, runs one optimizer step, then the forward and backward of a second one, and counts,
right before that second optimizer step, the bytes of every storage this rank holds, by kind:

- ``weights`` / ``trainable``: the frozen / trainable parameters' storages (ZeRO-3: ``ds_tensor`` partitions plus
  the whole data of persistent parameters; ZeRO-1/2: the flat buffer the trainable parameters are views of);
- ``master``: DeepSpeed's fp32 partitions; ``optimizer``: the torch optimizer's state tensors (0-dim ``step``
  counters are reported apart: host scalars);
- ``gradients``: ``param.grad``, DDP's buckets (``bucket_sizes`` from DDP's logging data), DeepSpeed's gradient
  partitions and ZeRO-3's reduce bucket;
- ``bucket_in_backward``: DeepSpeed ZeRO-1/2's reduce bucket, seen from inside backward (it is freed at its end);
- ``host``: under ZeRO-3 offload, the part of those bytes DeepSpeed keeps in host memory, by kind (:func:`offloaded`).

Set ``PLAN_CENSUS_TIMES=1`` for timings on stderr. Any other live tensor found through the garbage collector is listed under ``other`` so that a buffer the
accounting does not know about shows up. Rank ``r`` writes ``OUT.json`` with ``.r`` appended (``.NAME.r`` for a
``--case NAME``: :func:`main` counts several shapes in one launch).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch


def _build(cfg, device_map):
    from scale.modeling.build import _DTYPES, add_lora, build_model

    source = Path(cfg.model.name_or_path)
    if not (source.is_dir() and [p.name for p in source.iterdir()] == ["config.json"]):
        return build_model(cfg.model, cfg.lora, 49152, cfg.train.seed, device_map=device_map)
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(source / "config.json", encoding="utf-8") as fh:
        raw = json.load(fh)
    hf = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        base = AutoModelForCausalLM.from_config(hf, dtype=_DTYPES[cfg.model.dtype])
        base.config.use_cache = False
        if cfg.model.finetune == "full":  # as build_model does it
            from scale.modeling.build import checkpointing_kwargs
            from scale.modeling.finetune import make_full

            return make_full(base, checkpointing_kwargs(cfg.model) if cfg.model.gradient_checkpointing else None)
        model = add_lora(base, cfg.model, cfg.lora)
    model.train()
    return model


def main() -> None:
    """``plan_census.py OUT --config PATH [key=value ...] [--case NAME key=value ...]...``: without ``--case`` one
    count, written to ``OUT.<rank>``; with, one count per case (the common overrides, then the case's), one after
    the other in this process, written to ``OUT.<NAME>.<rank>``: a launch's start-up (~10 s of imports and process
    group on 2 cores) is paid once for all of a mode's shapes."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":  # tests/cpu_fsdp2.yaml: the CPU shim
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.fsdp_cpu import enable

        enable()
    out, args = sys.argv[1], sys.argv[2:]
    config = args[args.index("--config") + 1]
    args = [a for i, a in enumerate(args) if a != "--config" and (i == 0 or args[i - 1] != "--config")]
    marks = [i for i, a in enumerate(args) if a == "--case"]
    common = args[:marks[0]] if marks else args
    cases = [(args[i + 1], args[i + 2:j]) for i, j in zip(marks, marks[1:] + [len(args)])] or [(None, [])]
    from scale.cli import start_fast
    from scale.config.load import load_config
    from scale.modeling.build import needs_bitsandbytes

    cfgs = [(name, load_config(config, [*common, *extra])) for name, extra in cases]
    # as scale-train starts: bitsandbytes only where a case quantizes, the libraries' objects frozen
    start_fast(next((c for _, c in cfgs if needs_bitsandbytes(c.model)), cfgs[0][1]))
    for i, (name, cfg) in enumerate(cfgs):
        if i:  # a fresh Accelerator (its DeepSpeed config follows the case's model); the process group stays
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state()
            GradientState._reset_state()
        count(cfg, f"{out}.{name}" if name else out, before=_live_storages() if i else set())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # pytorch/pytorch#190489: gloo can abort at interpreter exit


def _live_tensors():
    """``(tensor, storage)`` of every tensor with elements the garbage collector tracks now; a DTensor is skipped (its
    local tensor is seen apart)."""
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and not hasattr(o, "to_local") and o.numel():
                yield o, o.untyped_storage()
        except (RuntimeError, ReferenceError):
            continue


def _live_storages() -> set[int]:
    """Storage pointers of every tensor alive now (found through the garbage collector)."""
    gc.collect()
    return {s.data_ptr() for _, s in _live_tensors()}


def offloaded(ds_opt, torch_opt) -> set[int]:
    """Storage pointers of what DeepSpeed's ZeRO-3 offload keeps in host memory (on a GPU machine; on CPU every tensor
    is in host memory, so where each would live is read from the structure that holds it): with ``offload_param``
    the flat buffers every parameter's partition (``ds_tensor``) is a view of (``param_groups_fp16_flat_cpu_memory``);
    with ``offload_optimizer`` the fp32 master partitions, their gradient buffers (``.grad``), the gradient partitions
    (``grad_partitions_flat_buffer``) and the optimizer's state. Everything else (parameters kept whole, the reduce
    bucket, gathered parameters) is on the device. DeepSpeed 0.19 ``runtime/zero/stage3.py``."""
    found: list = []
    if getattr(ds_opt, "offload_param", False):
        found += list(getattr(ds_opt, "param_groups_fp16_flat_cpu_memory", []))
    if getattr(ds_opt, "offload_optimizer", False):
        flat = list(getattr(ds_opt, "fp32_partitioned_groups_flat", []))
        found += flat + [t.grad for t in flat] + [getattr(ds_opt, "grad_partitions_flat_buffer", None)]
        found += [t for state in torch_opt.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {t.untyped_storage().data_ptr() for t in found
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr()}


def count(cfg, out: str, before: set[int]) -> None:
    """Count what this rank holds for ``cfg`` (module docstring) and write it to ``out.<rank>``; tensors whose
    storage was alive ``before`` (an earlier case's leftovers) are not this case's and are not counted."""
    import time

    from scale.distributed.launch import build_accelerator, plan_for_mode
    from scale.loss import tail as scale_loss
    from scale.training.parts.optimizer import make_optimizer

    t0 = time.perf_counter()

    def mark(what: str) -> None:
        if os.environ.get("PLAN_CENSUS_TIMES"):
            sys.stderr.write(f"census {what}: {time.perf_counter() - t0:.1f} s\n")

    acc = build_accelerator(cfg)
    plan = plan_for_mode(cfg, acc)
    model = _build(cfg, plan.device_map)
    mark("built")
    optimizer, _ = make_optimizer(cfg, model)
    model, optimizer = acc.prepare(model, optimizer)
    mark("prepared")
    inner = model.module if hasattr(model, "module") else model
    B, T = cfg.train.micro_batch_size, cfg.data.max_length
    ids = torch.randint(3, 400, (B, T), generator=torch.Generator().manual_seed(acc.process_index))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    batch = {"input_ids": ids.to(acc.device), "attention_mask": mask.to(acc.device)}
    ds_opt = model.optimizer if plan.deepspeed else None
    in_backward: list[int] = []

    def bucket_bytes() -> int:
        buckets = getattr(ds_opt, "ipg_buckets", {}) or {}
        return sum(b.numel() * b.element_size() for bucket in buckets.values()
                   for b in (bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer])
                   if isinstance(b, torch.Tensor))

    def grad_bytes() -> int:
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in inner.parameters()
                 if p.grad is not None and p.grad.numel()]
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
        return sum(storages.values())

    def embed_hook(module, args, output):  # its gradient is the last one backward computes
        if output.requires_grad:
            output.register_hook(lambda g: in_backward.append((bucket_bytes(), grad_bytes())))

    inner.get_input_embeddings().register_forward_hook(embed_hook)

    def forward_backward() -> None:
        tail, targets = scale_loss.forward_tail(model, batch, cfg.loss.threshold)
        num, den = scale_loss.tail_loss(tail, targets, torch.ones_like(targets, dtype=torch.float32))
        if plan.deepspeed:
            model.backward(num / den)  # the engine; accelerate's backward() would also step it
        else:
            acc.backward(num / den)

    def step() -> None:
        if plan.deepspeed:
            model.step()
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    forward_backward()
    mark("backward 1")
    step()
    mark("step 1")
    in_backward.clear()
    forward_backward()
    mark("backward 2")  # ZeRO-3's second pass is slow on CPU: DeepSpeed scans its module trace per release
    gc.collect()

    kinds: dict[int, tuple[str, int]] = {}   # storage pointer -> (kind, bytes)

    def add(t, kind: str) -> None:
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: a DTensor's local shard (padded storage)
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr():
            s = t.untyped_storage()
            kinds.setdefault(s.data_ptr(), (kind, s.nbytes()))

    for p in inner.parameters():
        kind = "trainable" if p.requires_grad else "weights"
        add(getattr(p, "ds_tensor", None), kind)
        add(p.data, kind)
        add(p.grad, "gradients")
    # A 4-bit weight's quant state, on the parameter; under FSDP2 (whose DTensor parameter drops it) on its
    # Linear4bit module, from which bitsandbytes restores it in forward (fix_4bit_weight_quant_state_from_module).
    for qs in [getattr(p, "quant_state", None) for p in inner.parameters()] + \
            [getattr(m, "quant_state", None) for m in inner.modules()]:
        if qs is not None and not isinstance(qs, torch.Tensor):
            for t in (qs.absmax, qs.code, qs.offset, getattr(qs.state2, "absmax", None),
                      getattr(qs.state2, "code", None)):
                add(t, "weights")
    for b in inner.buffers():
        add(b, "buffers")
    steps = 0
    torch_opt = ds_opt.optimizer if plan.deepspeed else optimizer.optimizer
    for state in torch_opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() == 0:
                steps += t.numel() * t.element_size()
            else:
                add(t, "optimizer")
    extra_gradients = 0
    if plan.deepspeed:
        for t in getattr(ds_opt, "single_partition_of_fp32_groups", []):
            add(t, "master")
        for t in getattr(ds_opt, "fp32_partitioned_groups_flat", []):
            add(t, "master")
            add(t.grad, "gradients")  # ZeRO-3 offload: its own fp32 gradient buffer per sub-group (else a view)
        for t in getattr(ds_opt, "fp32_groups_flat_partition", []):  # BF16_Optimizer (ZeRO-1, fp32 accumulation)
            add(t, "master")
        for t in getattr(ds_opt, "fp32_groups_gradients_flat", []):
            add(t, "gradients")
        for t in getattr(ds_opt, "averaged_gradients", {}).values():
            for g in (t if isinstance(t, list) else [t]):
                add(g, "gradients")
        add(getattr(ds_opt, "grads_in_partition", None), "gradients")
        add(getattr(ds_opt, "grad_partitions_flat_buffer", None), "gradients")
        for bucket in (getattr(ds_opt, "ipg_buckets", {}) or {}).values():
            for b in (bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]):
                add(b, "gradients")
    elif hasattr(model, "_get_ddp_logging_data"):
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        extra_gradients = sum(int(x) for x in sizes.split(",") if x.strip())   # C++ buckets: not Python tensors
    # A tensor a collective has just finished with can still be referenced from the process group's worker thread
    # (gloo releases a Work's inputs there, after wait() returns): such a transient is seen once, then gone. A tensor
    # counts as "other" only when it is still alive after a barrier and a second collection: a real leftover is.
    first = {s.data_ptr() for _, s in _live_tensors()}
    acc.wait_for_everyone()
    gc.collect()
    others = []
    for o, s in _live_tensors():
        if s.data_ptr() not in kinds and s.data_ptr() not in before and s.data_ptr() in first:
            kinds[s.data_ptr()] = ("other", s.nbytes())
            others.append([s.nbytes(), str(o.dtype), list(o.shape)])
    totals: dict[str, int] = {}
    for kind, nbytes in kinds.values():
        totals[kind] = totals.get(kind, 0) + nbytes
    totals["gradients"] = totals.get("gradients", 0) + extra_gradients
    host: dict[str, int] = {}  # ZeRO-3 offload: the storages DeepSpeed keeps in host memory, by kind
    for ptr in offloaded(ds_opt, torch_opt) if plan.deepspeed else ():
        kind, nbytes = kinds.get(ptr, ("other", 0))
        host[kind] = host.get(kind, 0) + nbytes
    result = {"host": host, "rank": acc.process_index, "world": acc.num_processes, "mode": plan.mode, "totals": totals,
              "step_scalars": steps, "bucket_in_backward": max((b for b, _ in in_backward), default=0),
              "grads_in_backward": max((g for _, g in in_backward), default=0),
              "others": sorted(others, reverse=True)[:20]}
    with open(f"{out}.{acc.process_index}", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
