"""The activations autograd saves for backward, counted, not modelled: one forward of the harness's tail loss
(:func:`scale.loss.tail.forward_tail`) runs on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes,
no data, no memory) at ``train.micro_batch_size`` x ``data.max_length``, and
``torch.autograd.graph.saved_tensors_hooks`` adds up the distinct storages autograd keeps for backward (parameters
excluded), with gradient checkpointing on and off (:func:`count_activations`); the in-step reference forward's peak of a
preference job likewise (:func:`count_reference_peak`). The model is :mod:`scale.planner.census`'s meta-device one.

The fake forward dispatches like a CPU one (a fake CUDA device needs a CUDA build of torch), which saves the same
tensors as CUDA's memory-efficient attention (query, key, value, output, log-sum-exp, the additive mask); under CUDA
autocast a few elementwise ops keep fp32 inputs that CPU autocast would not, so bf16 runs can differ by a few per cent.

No weights are loaded and no process group is started (no ``accelerate`` or ``torch.distributed`` import).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scale.config.schema import Config
from scale.loss import chunked
from scale.loss import tail as scale_loss
from scale.modeling.moe_counts import static_experts
from scale.modeling.split_experts import force_loop
from scale.objectives.pair_losses import side_logps
from scale.objectives.preference import reference_mode
from scale.planner.census import DTYPES, ParamInfo, PlanError, base_of


@dataclass
class Activations:
    """Bytes autograd keeps for backward after one micro-batch's forward (distinct storages, parameters excluded).

    Attributes:
        decoder: embedding and decoder layers (up to the LM head).
        head: from the LM head on: the LM head's saved inputs (under autocast, the low-precision copy of an fp32
            head weight, as QLoRA keeps it) and the loss's ``[B x N, V]`` fp32 log-softmax.
        per_layer: largest single decoder layer's share.
        layers: decoder layers seen.
        vocab: ``V``, the LM head's output width.
        recompute: under checkpointing, what one layer saves when backward recomputes it (the largest
            ``per_layer`` of a count without checkpointing); 0 without checkpointing.
        loss_positions: tail positions whose fp32 logits the loss holds at once: ``B x N`` unchunked, one
            chunk's ``C`` with ``loss.chunk_size`` (:mod:`scale.loss.chunked`).
        reference: a preference job's in-step DPO reference (``loss.reference: adapter``): the peak bytes of its
            ``no_grad`` forward over the micro-batch's rows (:func:`count_reference_peak`), alive on top of the
            policy's saved activations; 0 otherwise.
        moe_layer: a mixture-of-experts model's: the peak bytes one MoE layer's forward and backward add on the
            experts' LoRA path the run takes (:func:`scale.planner.moe.count_moe_layer`: on peft's, ``W + B A`` and
            its gradient); 0 for a dense model.
    """

    decoder: int
    head: int
    per_layer: int
    layers: int
    vocab: int = 0
    recompute: int = 0
    loss_positions: int = 0
    reference: int = 0
    moe_layer: int = 0

    @property
    def total(self) -> int:
        return self.decoder + self.head


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder stack: the longest ``nn.ModuleList`` in the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def trained_dtypes(model: torch.nn.Module, params: list[ParamInfo], cast: torch.dtype | None
                   ) -> tuple[Callable[[torch.nn.Parameter], torch.dtype], set[str]]:
    """``(dtype_of, quantized)``: the dtype a fake forward gives each parameter of the meta model (its census dtype;
    ``cast`` for every floating one when DeepSpeed casts the module; float32 for a 4-bit layer's weight, which
    computes in the compute dtype and returns its input's) and the names of the 4-bit weights."""
    dtypes = {p.name: p.dtype for p in params}
    quantized = {p.name for p in params if p.quantized}
    by_id: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), n)  # a tied weight goes by its first name, as in the census

    def dtype_of(p: torch.nn.Parameter) -> torch.dtype:
        name = by_id.get(id(p))
        if cast is not None and p.is_floating_point():
            return cast
        return torch.float32 if name in quantized else dtypes.get(name, p.dtype)

    return dtype_of, quantized


@contextmanager
def _fake_parameters(model: torch.nn.Module, mode: Any, dtype_of: Callable[[torch.nn.Parameter], torch.dtype]
                     ) -> Iterator[None]:
    """Swap the meta model's parameters and buffers for CPU fake tensors (tied ones stay tied); restore after."""
    from torch._subclasses.fake_tensor import FakeTensor

    cpu = torch.device("cpu")
    memo: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, Any]] = []

    def fake(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if id(t) not in memo:
            meta = t.detach().to(dtype) if t.is_floating_point() else t.detach()
            f = FakeTensor(mode, meta, cpu)
            memo[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return memo[id(t)]

    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None:
                    saved.append((store, name, t))
                    store[name] = fake(t, dtype_of(t) if isinstance(t, torch.nn.Parameter) else t.dtype)
    try:
        yield
    finally:
        for store, name, t in saved:
            store[name] = t


class _FourBitMatmul(torch.autograd.Function):
    """``bitsandbytes.matmul_4bit`` as its autograd sees it: ``x @ W^T`` in ``x``'s dtype, nothing saved for backward
    but the (frozen, 4-bit) weight; bitsandbytes 0.50's ``MatMul4Bit`` keeps ``ctx.tensors = (None, B)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # never run: the count is forward-only
        return None, None


@contextmanager
def four_bit_layers(model: torch.nn.Module, quantized: set[str], compute: torch.dtype) -> Iterator[None]:
    """Make the meta model's linear layers whose weight is 4-bit (``quantized``: parameter names from
    :func:`scale.planner.census.census`) run as ``bitsandbytes.nn.Linear4bit.forward`` does: the input cast to the
    compute dtype, the 4-bit matmul (which saves no activation), the output cast back to the *input's* dtype. After
    ``prepare_model_for_kbit_training``'s fp32 norms and embeddings that input is fp32, so QLoRA's residual stream and
    projections stay fp32 under autocast (a plain linear layer would return the autocast dtype and save a
    low-precision copy of its input instead). Restores the forwards after."""
    patched = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and f"{name}.weight" in quantized:

            def forward(x: torch.Tensor, mod: torch.nn.Module = mod) -> torch.Tensor:
                with torch.autocast("cpu", enabled=False):
                    out = _FourBitMatmul.apply(x.to(compute), mod.weight)
                    if mod.bias is not None:
                        out = out + mod.bias.to(compute)
                return out.to(x.dtype)

            mod.forward = forward
            patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            del mod.forward


@contextmanager
def ulysses_like_attention(model: torch.nn.Module, sp: int) -> Iterator[None]:
    """Within the block the model's attention does what DeepSpeed Ulysses does to the shapes on one of ``sp`` ranks
    (:mod:`scale.distributed.ulysses`): query/key/value ``[B, h, C, d]`` of the rank's ``C`` positions become ``[B, h /
    sp, sp x C, d]`` (all-to-all; key/value heads fewer than ``sp`` replicated first), the core attention runs causal
    over the whole sequence without a mask, and its output goes back to ``[B, C, h x d]``. On fake tensors the exchanges
    are stand-in copies of the same shapes: Ulysses' own all-to-all saves nothing for backward (DeepSpeed 0.19
    ``deepspeed::dim_zero_all_to_all``), the core attention saves what it saves for these shapes."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    core = ALL_ATTENTION_FUNCTIONS[impl]
    had, before = impl in ALL_ATTENTION_FUNCTIONS._local_mapping, ALL_ATTENTION_FUNCTIONS._local_mapping.get(impl)

    def exchange(x: torch.Tensor) -> torch.Tensor:
        B, h, C, d = x.shape
        if h < sp:
            x, h = x.repeat_interleave(sp // h, dim=1), sp
        return x.reshape(B, sp, h // sp, C, d).transpose(1, 2).reshape(B, h // sp, sp * C, d).contiguous()

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        B, C = query.shape[0], query.shape[2]
        out, weights = core(module, exchange(query), exchange(key), exchange(value), None, *args, **kwargs)
        return out.reshape(B, sp, C, -1).transpose(1, 2).reshape(B, C, -1).contiguous(), weights

    ALL_ATTENTION_FUNCTIONS[impl] = attention
    try:
        yield
    finally:
        if had:
            ALL_ATTENTION_FUNCTIONS[impl] = before
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]


def count_activations(cfg: Config, model: torch.nn.Module, params: list[ParamInfo], cast: torch.dtype | None = None,
                      padded: bool = True, packed: bool = False, sp: int = 1) -> Activations:
    """Count what autograd saves in one forward of the tail loss at ``micro_batch_size x max_length``.

    Args:
        cfg: the training config (micro-batch, length, threshold, mixed precision, 4-bit).
        model: from :func:`scale.planner.census.build_meta_model` (its checkpointing setting is the one counted).
        params: :func:`scale.planner.census.census` of that model (dtypes as trained).
        cast: every floating parameter held in this dtype (DeepSpeed with bf16/fp16 casts the module), or None.
        padded: the batch has padding, so attention gets a ``[B, 1, T, T]`` mask (each layer keeps its additive
            copy) and key/value are repeated to every query head; False: every row fills ``max_length``, the mask
            is skipped and SDPA attends with grouped key/value heads.
        packed: ``data.packing``: the micro-batch is one padding-free row of ``B x T`` tokens (bins
            that fill ``max_length``) whose block-diagonal ``[1, 1, BT, BT]`` mask transformers builds from the
            restarting position ids, and the LM head and loss see ``B x N`` positions (``N = T`` from
            :func:`scale.planner.plan.make_plan`: every token trained, the worst case); ``padded`` is ignored.
        sp: ``train.sequence_parallel_size``: the count of one of ``sp`` ranks sharing each row
            (:mod:`scale.data.sequence`): ``B`` rows of ``C = T / sp`` positions (``T`` rounded up to a multiple of
            ``sp``), no attention mask, the attention as Ulysses runs it (:func:`ulysses_like_attention`), and the
            LM head and loss over ``min(N, C)`` positions per row: the rank holding most of the tail (a tail shorter
            than a shard can lie on one rank whole); ``padded`` and ``packed`` are ignored.

    Returns:
        :class:`Activations` in bytes.

    Raises:
        PlanError: the architecture's forward cannot run on fake tensors (data-dependent shapes, e.g. some
            mixture-of-experts routers).
    """
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype_of, quantized = trained_dtypes(model, params, cast)
    B, T, N = cfg.train.micro_batch_size, cfg.data.max_length, cfg.loss.threshold
    if sp > 1:  # one rank's shard: C positions per row, the tail positions it may hold
        C = -(-T // sp)  # data.max_length rounded up to a multiple of sp, split in sp shards
        T, N = C, min(N, C)
        padded = packed = False
    mode = FakeTensorMode()
    layers = _decoder_layers(model)
    head_module = base_of(model).get_output_embeddings()
    V = head_module.weight.shape[0] if head_module is not None else 0
    chunk = (chunked.resolve_chunk_size(cfg.loss.chunk_size, B * N, V)
             if head_module is not None and not cfg.loss.trains_pairs() else 0)  # preference losses: unchunked
    phase = {"now": "embed"}
    per_phase: dict[str, int] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: phase.__setitem__("now", f"layer{i}"))
             for i, m in enumerate(layers)]
    if head_module is not None:
        hooks.append(head_module.register_forward_pre_hook(lambda mod, args: phase.__setitem__("now", "head")))
    seen: dict[int, tuple[str, int]] = {}
    autocast = cfg.train.mixed_precision != "no" and cast is None
    amp_dtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float16
    compute = DTYPES.get(cfg.model.bnb_4bit_compute_dtype, amp_dtype if autocast else torch.float32)  # "auto": amp
    try:
        with _fake_parameters(model, mode, dtype_of), four_bit_layers(model, quantized, compute), mode, \
                static_experts(), force_loop():
            param_storages = {p.untyped_storage()._cdata for p in model.parameters()}

            def pack(t: torch.Tensor) -> torch.Tensor:
                key = t.untyped_storage()._cdata
                if key not in param_storages and key not in seen:
                    seen[key] = (phase["now"], t.untyped_storage().nbytes())
                return t

            ids = torch.zeros(B, T, dtype=torch.long)
            batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long)}
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=amp_dtype, enabled=autocast):
                if packed:  # one row of B x T tokens; the mask comes from the (fake) segment ids
                    ids = torch.zeros(1, B * T, dtype=torch.long)
                    keep = (torch.arange(B * T - B * N, B * T) - 1).clamp(min=0)
                    segments = torch.zeros(1, B * T, dtype=torch.long)
                    with mock.patch("transformers.masking_utils.find_packed_sequence_indices",
                                    lambda *a, **k: segments), \
                            (chunked.head_returns_hidden(model) if chunk else nullcontext()):
                        tail = model(input_ids=ids, position_ids=torch.zeros_like(ids), logits_to_keep=keep,
                                     use_cache=False).logits
                    targets = ids[:, : B * N]
                elif padded and chunk:  # the chunked loss (scale.loss.chunked): hidden states, then chunk by chunk
                    with torch.device("cpu"):
                        batch["tail_mask"] = torch.ones(B, N, dtype=torch.long)
                    tail, targets = chunked.forward_tail_hidden(model, batch, padding_side="left", check=False)
                elif padded:
                    tail, targets = scale_loss.forward_tail(model, batch, N, padding_side="left", check=False)
                elif sp > 1:  # scale.loss.tail.forward_tail_shard's call: a shard of C positions, no mask
                    keep = torch.arange(T - N, T)
                    position_ids = torch.arange(T).expand(B, T)
                    with mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda *a, **k: None), \
                            ulysses_like_attention(model, sp), \
                            (chunked.head_returns_hidden(model) if chunk else nullcontext()):
                        tail = model(input_ids=ids, position_ids=position_ids, logits_to_keep=keep,
                                     use_cache=False).logits
                    targets = ids[:, :N]
                else:  # forward_tail's call; transformers drops an all-ones mask, so none is passed. On fake
                    # tensors it cannot read the positions to rule out packed rows (which would add a mask): full
                    # rows are not packed, so that check answers "not packed".
                    keep = torch.arange(T - N - 1, T - 1)
                    with mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda *a, **k: None):
                        tail = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
                    targets = ids[:, T - N:]
                if cfg.loss.trains_pairs():  # preference pairs: each row's summed tail logps (unchunked)
                    side_logps(tail, targets, torch.ones(targets.shape))[0].sum()
                elif chunk and (packed or padded or sp > 1):  # tail holds hidden states: the head runs chunk by chunk
                    chunked.chunked_tail_loss(model, tail, targets, torch.ones(targets.shape), chunk,
                                              drop_zero_weights=False)
                else:
                    scale_loss.tail_loss(tail, targets, torch.ones(targets.shape))
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        raise PlanError(f"cannot count activations of model type {model.config.model_type!r} on fake tensors "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    finally:
        for h in hooks:
            h.remove()
    for ph, nbytes in seen.values():
        per_phase[ph] = per_phase.get(ph, 0) + nbytes
    head = per_phase.pop("head", 0)
    layer_bytes = [v for k, v in per_phase.items() if k.startswith("layer")]
    return Activations(decoder=sum(per_phase.values()), head=head, per_layer=max(layer_bytes, default=0),
                       layers=len(layers), vocab=V, loss_positions=chunk or B * N)


def head_vocab(model: torch.nn.Module) -> int:
    """``V``: the LM head's output width (0 without one)."""
    head = model.get_base_model().get_output_embeddings() if hasattr(model, "get_base_model") else \
        model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else 0


class PeakBytes(TorchDispatchMode):
    """Follows every storage an op creates inside the mode, each forgotten when it is freed, and keeps the most
    bytes alive at once (``peak``): what ``torch.cuda.max_memory_allocated`` would add over the block, without the
    allocator's rounding. On fake tensors it counts shapes, no memory. The storages of ``existing`` (parameters,
    buffers, the input batch) are known from the start and never counted, so a view of one (the LM head's transposed
    weight) is not new memory."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.now, self.peak, self.refs = 0, 0, {}
        for t in existing:
            if isinstance(t, torch.Tensor):
                self.refs[t.untyped_storage()._cdata] = None  # known: never counted, never forgotten

    def add(self, t: Any) -> None:
        """Count ``t``'s storage once, until it is freed; anything that is not a tensor is ignored."""
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key in self.refs or not size:
            return
        self.now += size
        self.peak = max(self.peak, self.now)

        def freed(_: Any, key: int = key, size: int = size) -> None:
            self.now -= size
            self.refs.pop(key, None)

        self.refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.add(t)
        return out


def count_reference_peak(cfg: Config, model: torch.nn.Module, params: list[ParamInfo],
                         cast: torch.dtype | None = None, rows: int | None = None) -> int:
    """Peak bytes of the DPO reference's forward over one micro-batch: the model with its LoRA adapter disabled
    (:func:`scale.objectives.preference.reference_mode`), under ``no_grad``, then each row's summed tail logps
    (:func:`scale.objectives.pair_losses.side_logps`): the ``[rows, N, V]`` fp32 tail logits, the log-softmax's
    temporaries and one layer's intermediates, all freed when the forward returns. Counted on fake tensors as
    :func:`count_activations` counts (``rows`` x ``data.max_length``, ``N`` = ``loss.threshold``), every storage
    an op creates followed until it is freed (:class:`PeakBytes`), plus the one buffer no dispatch mode sees:
    ``torch.logsumexp`` allocates ``exp(x - max)``, ``[rows, N, V]`` fp32, inside its kernel (ATen
    ``logsumexp_out_impl``, every device) while the logits are alive.

    Args:
        cfg: the training config (length, threshold, mixed precision, 4-bit).
        model: from :func:`scale.planner.census.build_meta_model`.
        params: :func:`scale.planner.census.census` of that model.
        cast: every floating parameter held in this dtype (DeepSpeed with bf16/fp16), or None.
        rows: rows of the micro-batch (a preference micro-batch of ``P`` pairs: ``2P``); default
            ``train.micro_batch_size``.

    Returns:
        Bytes; the parameters and the input batch are not counted.

    Raises:
        PlanError: the forward cannot run on fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype_of, quantized = trained_dtypes(model, params, cast)
    B, T, N = rows or cfg.train.micro_batch_size, cfg.data.max_length, cfg.loss.threshold
    autocast = cfg.train.mixed_precision != "no" and cast is None
    amp_dtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float16
    compute = DTYPES.get(cfg.model.bnb_4bit_compute_dtype, amp_dtype if autocast else torch.float32)
    mode = FakeTensorMode()
    try:
        with _fake_parameters(model, mode, dtype_of), four_bit_layers(model, quantized, compute), mode, \
                static_experts(), force_loop():
            batch = {"input_ids": torch.zeros(B, T, dtype=torch.long),
                     "attention_mask": torch.ones(B, T, dtype=torch.long),
                     "tail_mask": torch.ones(B, N, dtype=torch.long)}
            peak = PeakBytes(*model.parameters(), *model.buffers(), *batch.values())
            with reference_mode(model), torch.autocast("cpu", dtype=amp_dtype, enabled=autocast), peak:
                tail, targets = scale_loss.forward_tail(model, batch, padding_side="left", check=False)
                side_logps(tail, targets, batch["tail_mask"])
                del tail, targets
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        raise PlanError(f"cannot count the reference forward of model type {model.config.model_type!r} on fake "
                        f"tensors ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    logits_bytes = B * N * head_vocab(model) * 4
    return peak.peak + logits_bytes  # + logsumexp's own exp(x - max) buffer
