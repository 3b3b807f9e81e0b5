"""Sequence parallelism on the DeepSpeed modes: DeepSpeed Ulysses, set up through accelerate's ``ParallelismConfig``.

    accelerate launch --config_file configs/accelerate/zero2.yaml -m scale.train --config ... \\
        train.sequence_parallel_size=2          # each row's tokens split over 2 ranks

With ``train.sequence_parallel_size: N`` the processes form groups of ``N`` consecutive ranks; the ranks of a
group train the same rows, each holding ``1/N`` of every row's tokens (:mod:`scale.data.sequence` builds the
shards), and the data-parallel degree is ``world / N``. Between the attention calls each rank computes only its
own positions (embeddings, MLPs, norms, LM head, loss: memory ``1/N``); inside each attention call Ulysses
trades the sequence shards for a share of the heads (all-to-all), runs the whole sequence's causal attention on
``heads / N`` heads and trades back (https://arxiv.org/abs/2309.14509; ALST, https://arxiv.org/abs/2506.13996).

What accelerate does (``Accelerator(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N))``,
accelerate 1.15 ``_prepare_deepspeed``): it builds DeepSpeed's sequence-parallel groups
(``parallel_state_sp.initialize_sequence_parallel``), hands them to ``deepspeed.initialize`` as ``mpu`` (so ZeRO
reduces gradients over all ranks and **divides by the data-parallel degree only**: the ``N`` ranks of a group are
summed, which is right, since each holds a part of the row's loss), and sets ``train_batch_size``. What this
module does instead of accelerate's defaults, and why:

- **the attention**: accelerate registers Ulysses with ``disable_in_eval=True``, so a model in eval mode attends
  only within its own shard (measured on a probe: eval loss 5.774 instead of 5.715, silently; the launch test's eval
  loss moves by 3.1e-3 without :func:`sharded` in evaluation), and with a fixed batch size
  (``micro_batch_size``), which the epoch's last, shorter micro-batch and every eval batch fail. After
  ``prepare`` this module registers its own wrapper around the same ``UlyssesSPAttentionHF`` (DeepSpeed 0.19):
  sharded wherever the harness runs sharded rows (:func:`sharded`, training and evaluation alike), the batch
  size read from each call, and the plain attention with its real mask everywhere else (generation, checks);
- **the loaders**: accelerate would wrap the train loader in ``UlyssesSPDataLoaderAdapter``, which shards the
  loader over *all* ranks and then lets each group train its ranks' batches in turn (another row order than
  every other launch mode, and it needs ``labels`` of the row's length). Here the loaders are sharded over the
  data-parallel ranks only (:meth:`SequenceParallel.loader`): the ranks of a group read the same micro-batch and
  each keeps its shard, so step ``s`` trains the same rows as in every other mode with the same global batch;
- **evaluation**: the eval rows are sharded too (:class:`ShardedForward`): each rank computes the logits asked
  for at its own positions, and a sum over the group (each entry non-zero on exactly one rank: exact) returns
  what one device's forward would; figures are gathered over the data-parallel ranks once
  (:meth:`SequenceParallel.gather_for_metrics`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from torch import Tensor

from scale.data.sequence import shard_padded

_ACTIVE = False  # inside sharded(): the attention joins the shards; outside it is the plain attention


@contextlib.contextmanager
def sharded() -> Iterator[None]:
    """Within the block the model's attention is the sequence-parallel one (every rank of the group must run the
    same forwards, and backwards, in it: their attention calls are collectives); outside it, the plain attention."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, True
    try:
        yield
    finally:
        _ACTIVE = before


def _ulysses_class() -> type:
    """``UlyssesSPAttentionHF`` whose batch size follows each call (DeepSpeed's is fixed at construction)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class Ulysses(UlyssesSPAttentionHF):
        def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            b = query.shape[0]  # [B, heads, C, head size]
            if b != self.batch_size:  # the shapes DeepSpeed asserts: [C, B, ...] and [T, B, ...]
                self.batch_size = b
                for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                    shape = list(getattr(self, name))
                    shape[1] = b
                    setattr(self, name, torch.Size(shape))
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)

    return Ulysses


@dataclass
class SequenceParallel:
    """This rank's place in the sequence- and data-parallel groups, and the sharded attention.

    Attributes:
        size: ``N``, ranks per sequence-parallel group (consecutive ranks, DeepSpeed's layout).
        rank: this rank's index in its group (``process_index % N``).
        data_parallel_size: groups (``world / N``).
        data_parallel_rank: this rank's group (``process_index // N``): the loaders' shard.
        attn_implementation: the core attention Ulysses wraps (``model.attn_implementation``, default sdpa).
    """

    size: int
    rank: int
    data_parallel_size: int
    data_parallel_rank: int
    attn_implementation: str = "sdpa"
    core: Any = None
    group: Any = None

    @classmethod
    def for_process(cls, acc: Accelerator, size: int, attn_implementation: str | None) -> SequenceParallel:
        """The layout for this process; keeps the plain attention function before ``prepare`` replaces it."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = attn_implementation or "sdpa"
        return cls(size, acc.process_index % size, acc.num_processes // size, acc.process_index // size, impl,
                   core=ALL_ATTENTION_FUNCTIONS[impl])

    def install(self, config: Any) -> None:
        """After ``acc.prepare``: register the harness's sequence-parallel attention (module docstring) for a model
        of this transformers ``config`` (the base model's).

        Raises:
            RuntimeError: DeepSpeed's sequence-parallel group does not hold the consecutive ranks assumed here.
        """
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.group = mpu.get_sequence_parallel_group()
        if (mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()) != (self.rank, self.size):
            raise RuntimeError(f"DeepSpeed's sequence-parallel group puts this rank at "
                               f"{mpu.get_sequence_parallel_rank()} of {mpu.get_sequence_parallel_world_size()}, not "
                               f"{self.rank} of {self.size}")
        text = config.get_text_config()
        attn = _ulysses_class()(
            attn=self.core, batch_size=1, attn_head_count=text.num_attention_heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            kv_head_count=text.num_key_value_heads, num_hidden_layers=text.num_hidden_layers,
            process_group=self.group, seq_length_is_variable=True, disable_in_eval=False)
        attn.core_attn_implementation = self.attn_implementation
        core, impl = self.core, self.attn_implementation

        def attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                      *args: Any, **kwargs: Any) -> Any:
            if not _ACTIVE:
                return core(module, query, key, value, attention_mask, *args, **kwargs)
            if impl != "flex_attention" or type(attention_mask).__name__ != "BlockMask":
                attention_mask = None  # built for the shard's length; the core attention runs causal instead
            return attn(module, query, key, value, attention_mask, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[impl] = attention

    def loader(self, acc: Accelerator, dl: Any, even_batches: bool) -> Any:
        """``dl`` prepared as ``acc.prepare`` would, but sharded over the data-parallel ranks only: the ``N``
        ranks of a group get the same batches (the train collator then keeps each rank's shard).

        ``even_batches``: repeat samples so that every group gets as many batches (evaluation, whose
        :meth:`gather_for_metrics` drops the repeats); the train loader keeps ``False`` (no sample repeated).
        """
        from accelerate.data_loader import prepare_data_loader

        prepared = prepare_data_loader(
            dl, acc.device, num_processes=self.data_parallel_size, process_index=self.data_parallel_rank,
            split_batches=acc.split_batches, put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(),
            dispatch_batches=acc.dispatch_batches, even_batches=even_batches,
            use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader)
        acc._dataloaders.append(prepared)  # as acc.prepare does: save_state/load_state keep its sampler's state
        return prepared

    def gather_for_metrics(self, acc: Accelerator, table: Tensor) -> Tensor:
        """``acc.gather_for_metrics`` over the data-parallel ranks: the rows of rank 0 of every group (its
        ``N`` ranks hold the same rows), without the samples repeated to even out the last batch. Collective.

        Args:
            table: ``[b, c]`` this rank's per-row figures; ``b`` is the same on every rank (``even_batches``).

        Returns:
            ``[rows, c]``, every eval row once, in the data-parallel ranks' order.
        """
        data = acc.gather(table)  # collective: [world x b, c]
        data = data.reshape(acc.num_processes, -1, *table.shape[1:])[::self.size].reshape(-1, *table.shape[1:])
        state = acc.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the remainder of the data-parallel sharding
            data = data[:state.remainder]
        return data

    def forward(self, model: torch.nn.Module) -> ShardedForward:
        """``model`` as an unsharded-looking forward for evaluation (:class:`ShardedForward`)."""
        return ShardedForward(model, self)


class ShardedForward(torch.nn.Module):
    """A causal LM over sequence-parallel ranks that a caller uses as one device's model (evaluation).

    ``forward(input_ids [B, T], attention_mask [B, T], position_ids, logits_to_keep [K], use_cache=False)``
    takes a padded batch (left or right) as :func:`scale.loss.tail.forward_tail` builds it, lays every row out from
    column 0, pads to a multiple of ``N`` (:func:`scale.data.sequence.shard_padded`), runs the model on this rank's
    shard under :func:`sharded`, computes the logits asked for at this shard's positions, and sums them over
    the group (each entry is non-zero on exactly one rank, so the sum is that rank's value, bit for bit).
    Returns an object with ``logits [B, K, V]``, as one device's model would. Every rank of the group must call it
    with the same batch (the eval loader is sharded over the data-parallel ranks only).
    """

    def __init__(self, model: torch.nn.Module, sp: SequenceParallel) -> None:
        super().__init__()
        self.inner, self.sp = model, sp

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                logits_to_keep: Tensor | int = 0, use_cache: bool = False, **_: Any) -> Any:
        from types import SimpleNamespace

        T = input_ids.shape[1]
        keep = (logits_to_keep if torch.is_tensor(logits_to_keep) else
                torch.arange(T - (logits_to_keep or T), T, device=input_ids.device))
        ids, pos, local, here = shard_padded(input_ids, attention_mask, keep, self.sp.rank, self.sp.size)
        cols = torch.unique(local[here]) if bool(here.any()) else local.new_zeros(1)  # host sync (eval only)
        with sharded():
            out = self.inner(input_ids=ids, position_ids=pos, logits_to_keep=cols, use_cache=False)
        inv = torch.searchsorted(cols, local).clamp(max=cols.numel() - 1)               # [B, K]
        picked = out.logits.gather(1, inv[..., None].expand(-1, -1, out.logits.shape[-1]))
        full = picked.float().masked_fill(~here[..., None], 0.0)                        # [B, K, V]
        torch.distributed.all_reduce(full, group=self.sp.group)  # collective: the group's ranks
        return SimpleNamespace(logits=full.to(picked.dtype))
