"""Load the base model (full precision or 4-bit), add LoRA, enable gradient checkpointing. No Accelerator.

``build_model(cfg.model, cfg.lora, ...)`` returns a ``peft.PeftModel`` whose only trainable parameters are
the LoRA matrices. Workarounds carry their reason and link:

- Gradient checkpointing goes through the model's own API with ``use_reentrant=False`` by default:
  re-entrant checkpointing breaks DDP + LoRA ("marked ready twice", peft#313, trl#921).
- Input-embedding outputs require grad when checkpointing a frozen base (peft#137), which transformers'
  transformers' checkpointing call does itself (:func:`scale.compat.enable_checkpointing`: the API moved in 5.23).
- ``use_cache=False`` while training; :func:`restore_inference_config` puts it back before saving.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scale import moe
from scale.compat import enable_checkpointing
from scale.assets import EMBEDDED_MODEL, resolve_model
from scale.config import ConfigError, LoraConfig, ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY = "tiny-llama"


def tokenizer_source(cfg: ModelConfig) -> str:
    """Where ``cfg``'s tokenizer comes from: ``model.tokenizer``, else the model (``tiny-llama``: SmolLM2's)."""
    return cfg.tokenizer or ("smollm2-135m" if cfg.name_or_path == TINY else cfg.name_or_path)


# (resolved source, trust_remote_code, the directory's files) -> the tokenizer as loaded; never handed out itself
_TOKENIZERS: dict[tuple[Any, ...], Any] = {}


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer for ``cfg`` (``tiny-llama`` borrows SmolLM2's); pad token falls back to EOS.

    Loaded once per process and source (a run asked for it 3 times: the data, the samples, the saved adapter;
    ``from_pretrained`` took ~0.7 s each): later calls get a deep copy of the first load, so a caller that edits
    its tokenizer (``serving_tokenizer`` sets the chat template) never changes another's. A directory is keyed
    on its files' names, sizes and mtimes too: a tokenizer saved again in the same place is read again.
    """
    import copy

    from transformers import AutoTokenizer

    source = tokenizer_source(cfg)
    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    with loading(key, source):
        path = resolve_model(source)
        files = Path(path)
        stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(files.iterdir())
                      if f.is_file()) if files.is_dir() else None
        memo = (path, cfg.trust_remote_code, stamp)
        if memo not in _TOKENIZERS:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            _TOKENIZERS[memo] = tok
    return copy.deepcopy(_TOKENIZERS[memo])


@contextlib.contextmanager
def loading(key: str, value: str) -> Iterator[None]:
    """Turn transformers' ``OSError`` for a model it cannot find (no such directory, a hub id without network
    or access, missing weight files) into one :class:`ConfigError` line naming the config key and the fix."""
    try:
        yield
    except OSError as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"{key}={value!r} could not be loaded: {first[:300]} (no network or no access to the "
                          f"Hugging Face Hub? download it with `hf download {value} --local-dir DIR` and set "
                          f"{key}=DIR)") from None


def tiny_llama_config(cfg: ModelConfig, vocab_size: int) -> Any:
    """A small ``LlamaConfig`` built from ``model.tiny_*`` fields (no download)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.tiny_hidden_size,
        intermediate_size=cfg.tiny_intermediate_size,
        num_hidden_layers=cfg.tiny_num_layers,
        num_attention_heads=cfg.tiny_num_heads,
        num_key_value_heads=cfg.tiny_num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        use_cache=False,
    )


def needs_bitsandbytes(cfg: ModelConfig) -> bool:
    """Whether loading ``cfg``'s model can need bitsandbytes: ``model.quantize_4bit``, a directory whose
    ``config.json`` holds a ``quantization_config`` (a checkpoint quantized on disk), or a hub id (not looked
    into before it is loaded). The built-in ``tiny-llama`` and the embedded SmolLM2 never do."""
    if cfg.quantize_4bit:
        return True
    if cfg.name_or_path in (TINY, EMBEDDED_MODEL):
        return False
    config = Path(cfg.name_or_path) / "config.json"
    if not config.is_file():
        return True
    import json

    try:
        return "quantization_config" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # let the load report what is wrong with it


def keep_bitsandbytes_out(cfg: ModelConfig) -> bool:
    """For a process of its own that loads ``cfg``'s model (a command, not a library caller, which may load QLoRA
    next): make bitsandbytes unimportable unless the model can need it (:func:`needs_bitsandbytes`).

    peft and transformers import bitsandbytes whenever it is installed, and bitsandbytes 0.50 wraps its CPU kernels
    in ``torch.compile`` at import, which imports inductor (~2.5 s of CPU on 2 cores) and logs a hub-kernel notice.
    ``sys.modules["bitsandbytes"] = None`` is Python's own way to make an import fail
    (https://docs.python.org/3/reference/import.html#the-module-cache): peft and transformers then treat it as not
    installed.

    Returns:
        Whether it was kept out (False: needed, or imported already).
    """
    if needs_bitsandbytes(cfg) or "bitsandbytes" in sys.modules:
        return False
    sys.modules["bitsandbytes"] = None
    return True


def check_attention(cfg: ModelConfig) -> None:
    """``model.attn_implementation`` can run on this machine, checked before anything is loaded or written.

    transformers raises an ``ImportError`` from inside ``from_pretrained`` for ``flash_attention_2`` without the
    ``flash-attn`` package or a CUDA device (``is_flash_attn_2_available``, which also accepts the hub kernel
    fallback when the ``kernels`` package is installed).

    Raises:
        ConfigError: the kernel cannot run here; the message names the missing piece and the kernels that run.
    """
    if cfg.attn_implementation != "flash_attention_2":
        return
    import importlib.util

    from transformers.utils import is_flash_attn_2_available, is_torch_flex_attn_available

    try:
        available = is_flash_attn_2_available(kernels_fallback_ok=True)
    except TypeError:  # transformers without the hub kernel fallback
        available = is_flash_attn_2_available()
    if available:
        return
    missing = ("the flash-attn package is not installed (pip install flash-attn, on a CUDA machine)"
               if importlib.util.find_spec("flash_attn") is None else "flash-attn needs a CUDA GPU and none is visible")
    runs = ["sdpa (null: transformers' default)", "eager"] + (["flex_attention"] if is_torch_flex_attn_available()
                                                              else [])
    raise ConfigError(f"model.attn_implementation=flash_attention_2 cannot run here: {missing}; kernels that run "
                      f"here: {', '.join(runs)}; set model.attn_implementation=sdpa (or null)")


def bnb_config(cfg: ModelConfig) -> Any:
    """The ``BitsAndBytesConfig`` for QLoRA (NF4, double quantization, compute and storage dtypes)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant,
        # "auto" is resolved at start-up (scale.metrics.resolve_mixed_precision); unresolved it computes in fp32
        bnb_4bit_compute_dtype=_DTYPES.get(cfg.bnb_4bit_compute_dtype, torch.float32),
        bnb_4bit_quant_storage=getattr(torch, cfg.bnb_4bit_quant_storage),
    )


def load_base(cfg: ModelConfig, vocab_size: int, seed: int, device_map: Any = None) -> torch.nn.Module:
    """Load (or, for ``tiny-llama``, build with ``seed``) the base causal LM, 4-bit when ``quantize_4bit``.

    Args:
        cfg: the model section.
        vocab_size: tokenizer size; used by ``tiny-llama`` only.
        seed: initialises ``tiny-llama`` weights.
        device_map: passed to ``from_pretrained`` for 4-bit loading (one device per rank); None lets
            transformers place the weights (required under ZeRO-3).

    Returns:
        A transformers ``PreTrainedModel`` with ``use_cache=False``, attending with ``model.attn_implementation``
        (recorded in its config as ``_attn_implementation``).

    Raises:
        ImportError: ``quantize_4bit`` without bitsandbytes (``pip install 'scale[qlora]'``).
    """
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    kwargs: dict[str, Any] = {"dtype": _DTYPES[cfg.dtype], "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.quantize_4bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise ImportError("model.quantize_4bit=true needs bitsandbytes: pip install 'scale[qlora]'") from e
        kwargs["quantization_config"] = bnb_config(cfg)
        if device_map is not None:  # None under ZeRO-3, which places (and partitions) weights itself
            kwargs["device_map"] = device_map
    if cfg.name_or_path == TINY:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            config = tiny_llama_config(cfg, vocab_size)
            if cfg.attn_implementation is not None:
                config._attn_implementation = cfg.attn_implementation
            model = LlamaForCausalLM(config).to(_DTYPES[cfg.dtype])
        if cfg.quantize_4bit:
            model = reload_from_directory(model, **kwargs)
    else:
        with loading("model.name_or_path", cfg.name_or_path):
            model = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.name_or_path), **kwargs)
    model.config.use_cache = False
    if cfg.quantize_4bit:
        disable_cpu_inference_packing(model)
    return model


def reload_from_directory(model: torch.nn.Module, **from_pretrained_kwargs: Any) -> torch.nn.Module:
    """Reload an in-memory model through a temporary directory, e.g. to quantize it (bitsandbytes quantizes
    at load time). Written by hand, not with ``save_pretrained``, which writes on global rank 0 only while
    every rank needs the files. The returned model replaces ``model``."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        save_model(model, f"{tmp}/model.safetensors")
        return AutoModelForCausalLM.from_pretrained(tmp, **from_pretrained_kwargs)


def disable_cpu_inference_packing(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference; return how many layers it touched.

    On a CPU with AVX512-BF16, ``bnb.nn.Linear4bit.forward`` in eval mode converts its weight *in place*
    to an inference layout (bf16 absmax, no double quantization) that ``matmul_4bit`` then serves with
    ``gemv_4bit``, an op with no autograd kernel. After one evaluation pass (we evaluate at step 0) the
    layer stays converted in train mode, and no gradient flows through the frozen base layers: measured
    on a 2-layer tiny Llama, 10 of 14 LoRA gradient tensors came out exactly zero (bitsandbytes 0.50.2
    warns "gemv_4bit: an autograd kernel was not registered"). With the flag off, LoRA gradients equal
    those of an fp32 model holding the dequantized weights (tests/test_qlora.py). Remove when bitsandbytes
    converts back on ``train()`` or registers an autograd kernel.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def add_lora(model: torch.nn.Module, model_cfg: ModelConfig, lora_cfg: LoraConfig) -> torch.nn.Module:
    """Freeze the base, prepare k-bit training, enable checkpointing and wrap with a LoRA adapter.

    A mixture-of-experts model (fused 3-D experts) gets its targets from :mod:`scale.moe`: the linear layers by
    name and every expert's weights as peft ``target_parameters``, routers frozen unless ``lora.train_router``,
    ``lora.dropout`` on the linear layers' adapters only, the experts kept in their loaded dtype under 4-bit.

    Returns:
        A ``peft.PeftModel``; only ``lora_A``/``lora_B`` require grad.

    Raises:
        ConfigError: ``lora.target_modules`` names a layer the model does not have.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    layout = moe.moe_layout(model)  # None for a dense model
    loaded = {n: p.dtype for n, p in model.named_parameters()} if layout is not None else {}
    if model_cfg.quantize_4bit:
        # Casts norms to fp32 and freezes the base. Checkpointing is enabled below, once, our way.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        if layout is not None:
            moe.restore_expert_dtype(model, layout, loaded)
    if model_cfg.gradient_checkpointing:
        # Also makes the embedding output require grad, so checkpointed blocks of a frozen base still
        # pass gradient to LoRA (peft#137).
        enable_checkpointing(model, **checkpointing_kwargs(model_cfg))
    if layout is not None:  # fused experts: explicit module and parameter names (scale.moe)
        targets = moe.lora_targets(layout, lora_cfg.target_modules, lora_cfg.train_router, linear_names(model))
        peft_cfg = PeftLoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, task_type="CAUSAL_LM",
                                  lora_dropout=0.0 if targets.parameters else lora_cfg.dropout,
                                  target_modules=targets.modules, target_parameters=targets.parameters or None)
        with moe.explicit_targets():
            model = get_peft_model(model, peft_cfg)
        if targets.parameters:
            moe.set_linear_dropout(model, lora_cfg.dropout)
        return model
    check_lora_targets(model, lora_cfg.target_modules)
    peft_cfg = PeftLoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def checkpointing_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Arguments of :func:`scale.compat.enable_checkpointing` for ``model.gradient_checkpointing``:
    ``true`` every layer, ``every_n`` every ``checkpoint_every_n_layers``-th layer, ``offload`` every layer with
    the saved layer inputs in (pinned) host memory (``torch.autograd.graph.save_on_cpu``). Without a GPU the
    activations already live in host memory and transformers 5.24's offload fails on CPU ("pin_memory=True
    requires a CUDA or other accelerator backend"), so ``offload`` checkpoints every layer there, as ``true``."""
    return {"activation_checkpointing_kwargs": {"use_reentrant": cfg.use_reentrant},
            "every_n_layers": cfg.checkpoint_every_n_layers if cfg.gradient_checkpointing == "every_n" else 1,
            "offload": cfg.gradient_checkpointing == "offload" and torch.cuda.is_available()}


# Layer types (transformers' ``config.layer_types``) that attend only within a packed example: every mask-based
# attention honours the position ids that restart per example; convolutions, linear attention and SSM scans run
# along the whole packed row.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")


def packing_leak(config: Any) -> str | None:
    """Why packed rows would leak into each other in this model family, or None when they cannot.

    Reads ``layer_types`` (and Jamba-style ``layers_block_type``) of the (text) config: a layer that is no
    attention (Qwen3.5/Qwen3-Next ``linear_attention``: Gated DeltaNet + causal conv1d; LFM2 ``conv``; Falcon-H1
    ``hybrid``: a Mamba-2 mixer beside attention; Mamba ``linear_attention``) mixes each example with the end
    of the one before it, whatever the position ids say. Measured on tiny Qwen3.5: step-1 loss off by 2.1e-3
    (../shared/cases/turn3/C44). The boundary-aware kernels (flash-linear-attention with ``cu_seqlens``,
    ``causal_conv1d`` with ``seq_idx``) are not wired into the harness's packed forward, so these families are
    refused rather than trained on another loss.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found: list[str] = []
    for c in (config, text):
        for attr in ("layer_types", "layers_block_type"):
            for t in getattr(c, attr, None) or []:
                if t not in ATTENTION_LAYER_TYPES and t not in found:
                    found.append(t)
    if not found:
        return None
    return (f"model type {getattr(config, 'model_type', '?')!r} has {', '.join(repr(t) for t in found)} layers "
            f"(convolution / linear attention / state-space), which run along the whole packed row: each example "
            f"would see the end of the previous one")


def check_packing(model: torch.nn.Module, padding_free: bool, packing: bool = False) -> None:
    """Refuse ``data.padding_free`` (or ``data.packing``) on a model family whose layers leak across packed examples.

    Raises:
        ConfigError: one line naming the family and the layer types (:func:`packing_leak`).
    """
    if not (padding_free or packing):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    why = packing_leak(base.config)
    if why:
        key = "data.padding_free" if padding_free else "data.packing"
        raise ConfigError(f"{key}=true cannot be exact here: {why}. Set {key}=false "
                          f"(padded batches; data.group_by_length=true keeps padding low)")


# Attention kernels the sequence-parallel attention (DeepSpeed Ulysses) can wrap; eager needs a [T, T] mask, which
# Ulysses drops (deepspeed/runtime/sequence_parallel/ulysses_sp.py refuses it).
SEQUENCE_PARALLEL_ATTENTION = ("sdpa", "flash_attention_2", "flex_attention")
# Kernels that keep several examples of one row apart from the restarting position ids alone (varlen), once Ulysses
# has dropped the mask; sdpa and flex then attend causally across the whole row.
VARLEN_ATTENTION = ("flash_attention_2",)


def sequence_parallel_attention_problem(attn_implementation: str) -> str | None:
    """Why ``model.attn_implementation`` cannot run under sequence parallelism (:data:`SEQUENCE_PARALLEL_ATTENTION`),
    or None: the part of :func:`sequence_parallel_problem` the config alone decides, so it is checked before a
    process group, an Accelerator or a model exists (:func:`check_sequence_parallel_config`)."""
    if attn_implementation in SEQUENCE_PARALLEL_ATTENTION:
        return None
    return (f"model.attn_implementation={attn_implementation} is not an attention the sequence-parallel attention can "
            f"wrap (Ulysses drops the [T, T] mask eager needs); set model.attn_implementation=sdpa (or null), or "
            f"flash_attention_2 on a GPU")


def check_sequence_parallel_config(cfg: ModelConfig, sp_size: int) -> None:
    """Refuse ``train.sequence_parallel_size > 1`` with an attention it cannot wrap, from the config alone: before
    the Accelerator is built (accelerate's own check of the attention, ``DeepSpeedSequenceParallelConfig``, would
    otherwise stop every rank with a ``ValueError`` traceback while it is built).

    Raises:
        ConfigError: one line naming ``model.attn_implementation`` and the fix.
    """
    why = sequence_parallel_attention_problem(cfg.attn_implementation or "sdpa") if sp_size > 1 else None
    if why:
        raise ConfigError(f"train.sequence_parallel_size={sp_size} cannot be exact here: {why}")


def sequence_parallel_problem(config: Any, attn_implementation: str, sp_size: int, packed: bool,
                              max_length: int) -> str | None:
    """Why ``train.sequence_parallel_size=sp_size`` cannot be exact for this model, or None when it can.

    Ulysses (:mod:`scale.ulysses`) shards the sequence between the attention calls and, around each attention call,
    trades the shards for a share of the heads (all-to-all), runs the whole sequence's attention on ``heads / N``
    heads with *no mask* (causal), and trades back. So:

    - the attention must be a kernel it wraps (:data:`SEQUENCE_PARALLEL_ATTENTION`; eager needs a mask);
    - every layer must be full causal attention: a sliding window or a chunked layer would silently attend
      further than trained (its mask is dropped), and convolution / linear-attention / state-space layers run along
      the shard alone, restarting their state on every rank (:func:`packing_leak`; accelerate's
      ``_refuse_recurrent_layers_under_sequence_parallelism``);
    - the query heads and the key/value heads must divide among the ``N`` ranks (key/value heads may also be
      fewer, dividing ``N``: they are then replicated), with one head size for queries, keys and values;
    - several examples in one row (``data.packing``, ``data.padding_free``) stay apart only under varlen attention
      (:data:`VARLEN_ATTENTION`), which reads the restarting position ids.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = getattr(config, "model_type", "?")
    why = sequence_parallel_attention_problem(attn_implementation)
    if why:
        return why
    types = {t for c in (config, text) for a in ("layer_types", "layers_block_type") for t in getattr(c, a, None) or []}
    recurrent = sorted(t for t in types if t not in ATTENTION_LAYER_TYPES)
    if recurrent:
        return (f"model type {family!r} has {', '.join(repr(t) for t in recurrent)} layers (convolution / linear "
                f"attention / state-space), which run along the sequence outside the attention: each rank would "
                f"restart their state on its own shard")
    masked = sorted(t for t in types if t not in ("full_attention", "attention"))
    window = getattr(text, "sliding_window", None)
    if masked or (window and window < max_length and getattr(text, "use_sliding_window", True) is not False):
        kinds = ", ".join(repr(t) for t in masked) or f"sliding_window={window} (< data.max_length={max_length})"
        return (f"model type {family!r} has {kinds} attention: its mask is stricter than causal and the "
                f"sequence-parallel attention drops masks, so it would attend beyond the window")
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if not isinstance(heads, int) or not isinstance(kv, int):
        return (f"model type {family!r} does not name num_attention_heads and num_key_value_heads in its config: the "
                f"sequence-parallel attention cannot split its heads")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if any(getattr(text, k, None) not in (None, head_dim) for k in ("v_head_dim", "qk_head_dim")) \
            or getattr(text, "kv_lora_rank", None):
        return (f"model type {family!r} uses latent or unequal query/value heads (MLA), which the sequence-parallel "
                f"attention cannot split")
    if heads % sp_size:
        return (f"its {heads} attention heads do not divide among train.sequence_parallel_size={sp_size} ranks; "
                f"choose a divisor of {heads}")
    if kv % sp_size and sp_size % kv:
        return (f"its {kv} key/value heads neither divide among train.sequence_parallel_size={sp_size} ranks nor "
                f"divide {sp_size}; choose a size that does")
    if packed and attn_implementation not in VARLEN_ATTENTION:
        return (f"several examples share a row (data.packing or data.padding_free) and "
                f"model.attn_implementation={attn_implementation} cannot keep them apart once the sequence-parallel "
                f"attention drops the mask; set data.packing=false and data.padding_free=false (each example gets "
                f"its own row) or use flash_attention_2")
    return None


def check_sequence_parallel(model: torch.nn.Module, model_cfg: ModelConfig, sp_size: int, packed: bool,
                            max_length: int) -> None:
    """Refuse ``train.sequence_parallel_size > 1`` where it cannot be exact (:func:`sequence_parallel_problem`).

    Raises:
        ConfigError: one line naming the reason and the fix.
    """
    if sp_size == 1:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    attn = model_cfg.attn_implementation or getattr(base.config, "_attn_implementation", None) or "sdpa"
    why = sequence_parallel_problem(base.config, attn, sp_size, packed, max_length)
    if why:
        raise ConfigError(f"train.sequence_parallel_size={sp_size} cannot be exact here: {why}")


def linear_names(model: torch.nn.Module) -> list[str]:
    """Full names of the model's matmul layers that LoRA can adapt (``nn.Linear``, 4-bit linear, GPT-2's
    ``Conv1D``), the LM head excepted: ``model.layers.0.self_attn.q_proj``, ``transformer.h.0.attn.c_attn``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, m in model.named_modules()
            if m is not head and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")]


def check_lora_targets(model: torch.nn.Module, targets: list[str] | str) -> None:
    """Every name in a ``lora.target_modules`` list must name a matmul layer of this model family.

    peft raises only when no name matches, and silently skips the others: ``[q_proj, v_proj]`` on GPT-2
    (``c_attn``) or Phi-3 (fused ``qkv_proj``) would train fewer adapters than asked, or fail deep in peft.

    Raises:
        ConfigError: a listed name matches no matmul layer; the message lists the model's names.
    """
    if isinstance(targets, str):  # 'all-linear' or a regular expression: peft's own rules
        return
    names = linear_names(model)
    unknown = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]  # peft's suffix rule
    if unknown:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(f"lora.target_modules: {unknown} match no linear layer of this {type(model).__name__}; "
                          f"its linear layers are {short} (or use all-linear)")


def build_model(model_cfg: ModelConfig, lora_cfg: LoraConfig, vocab_size: int, seed: int,
                device_map: Any = None) -> torch.nn.Module:
    """Base model + LoRA, ready for training. LoRA weights are initialised from ``seed``.

    Args:
        model_cfg: the model section.
        lora_cfg: the lora section.
        vocab_size: tokenizer size (``tiny-llama`` only).
        seed: RNG seed for tiny weights and LoRA init.
        device_map: per-rank device for 4-bit loading.

    Returns:
        The PEFT model in train mode.
    """
    base = load_base(model_cfg, vocab_size, seed, device_map)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = add_lora(base, model_cfg, lora_cfg)
    model.train()
    return model


def restore_inference_config(model: torch.nn.Module) -> None:
    """Turn the KV cache back on in the saved config (training ran with ``use_cache=False``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.use_cache = True


def full_numel(p: torch.nn.Parameter) -> int:
    """Elements of ``p`` as stored, counting a ZeRO-3 partitioned parameter at its full size (``ds_numel``)."""
    return getattr(p, "ds_numel", p.numel())


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts; 4-bit weights count their logical elements, ZeRO-3
    partitioned ones their full size (``ds_numel``)."""
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    total = 0
    for p in model.parameters():
        n = full_numel(p)
        if p.__class__.__name__ == "Params4bit":
            n = p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else n * 2
        total += n
    return trainable, total


# ---------------------------------------------------------------------------------------------------------------
# CPU mixed precision: where bf16 pays and where it does not.
#
# Under ``torch.autocast("cpu", bfloat16)`` only the GEMMs gain (oneDNN's AMX / AVX512-BF16 kernels); everything
# around them paid for casts and for one slow kernel. Each path below is measured alone by
# ``benchmarks/bf16_paths.py`` (time and LoRA-gradient difference against the fp32 model), docs/benchmarks.md.

ATTENTION_FP32_BELOW = 256
"""Key length (tokens) below which :func:`mixed_sdpa` computes attention in float32 on CPU although autocast asks
for bf16/fp16. torch's CPU flash-attention kernel runs its bf16 backward as 4 small ``cpublas::gemm`` calls per
(row, head) and query/key block (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), each paying oneDNN's
per-call overhead where fp32 calls MKL's SGEMM: at 42 tokens (8 rows, 9 heads, head size 64) bf16 forward +
backward measured 11.0 ms against 3.1 ms in fp32 (inputs cast included); at 256 tokens they were even, at 1,024
tokens bf16 was 1.6x faster (50 vs 82 ms)."""

MIXED_SDPA = "sdpa_cpu_mixed"
"""The name :func:`use_mixed_sdpa` registers :func:`mixed_sdpa` under with transformers' ``AttentionInterface``."""


def mixed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' ``sdpa_attention_forward``, in float32 on CPU for keys shorter than
    :data:`ATTENTION_FP32_BELOW` where it would compute in bf16/fp16 (autocast, or half-precision inputs).

    Args:
        module: the attention layer (transformers passes it).
        query: ``[B, heads, Tq, D]``.
        key: ``[B, kv_heads, Tk, D]``.
        value: ``[B, kv_heads, Tk, D]``.
        attention_mask: boolean or additive ``[B, 1, Tq, Tk]`` mask, or None (causal).
        **kwargs: passed on (``dropout``, ``scaling``, ``is_causal``...).

    Returns:
        ``(output [B, Tq, heads, D], None)`` in the dtype sdpa would have returned (the autocast dtype under
        autocast): the result differs from the bf16 kernel's by bf16 round-off only, the fp32 one being closer to
        an fp32 run.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    half = (torch.bfloat16, torch.float16)
    dev = query.device.type
    autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in half
    if dev != "cpu" or key.shape[-2] >= ATTENTION_FP32_BELOW or not (autocast or query.dtype in half):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out_dtype = torch.get_autocast_dtype(dev) if autocast else query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(dev, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(out_dtype), weights


def use_mixed_sdpa(model: torch.nn.Module, on: bool = True) -> bool:
    """Switch a model attending with ``sdpa`` to :func:`mixed_sdpa` (``on``) or back; return whether it changed.

    Registered with transformers' ``AttentionInterface`` (and sdpa's mask function with ``AttentionMaskInterface``)
    as https://huggingface.co/docs/transformers/attention_interface shows. The name lives in the config's
    ``_attn_implementation``, which ``save_pretrained`` does not write: saved configs and adapters are unchanged.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(MIXED_SDPA, mixed_sdpa)
    AttentionMaskInterface.register(MIXED_SDPA, sdpa_mask)
    config = _base(model).config
    now, want = ("sdpa", MIXED_SDPA) if on else (MIXED_SDPA, "sdpa")
    if getattr(config, "_attn_implementation", None) != now:
        return False
    config._attn_implementation = want
    return True


def _base(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "get_base_model"):
        model = model.module  # DDP / DeepSpeed wrappers
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# The last cast made by _adapter_input_hook: (input, its version, grad mode, cast). q/k/v (and gate/up) read the same
# normed hidden states; they share one cast instead of making three (two).
_LAST_CAST: list[Any] = [None]


def _adapter_input_hook(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return None
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return None
    dtype, grad = torch.get_autocast_dtype(dev), torch.is_grad_enabled()
    last = _LAST_CAST[0]
    if last is not None and last[0]() is x and last[1] == x._version and last[2] == grad and last[3].dtype == dtype:
        return (last[3], *args[1:])
    cast = x.to(dtype)
    _LAST_CAST[0] = (weakref.ref(x), x._version, grad, cast)
    return (cast, *args[1:])


def cast_adapter_inputs_once(model: torch.nn.Module, on: bool = True) -> int:
    """Under autocast, cast each LoRA layer's float32 input to the autocast dtype once, at the layer's entry, so that
    the base layer and the adapter read the same copy (and layers reading the same input, q/k/v, share it); return
    how many layers it touched.

    Without it, a LoRA layer on a bitsandbytes 4-bit base casts its input twice (``Linear4bit`` to its compute
    dtype, autocast again for ``lora_A``) and casts the base's output back to float32; peft skips its own input cast
    only under CUDA autocast (``torch.is_autocast_enabled()`` without a device is CUDA's), so on CPU it also casts a
    half input up to the adapter's float32 (peft's ``cast_input_dtype_enabled``, switched off here as peft's
    ``disable_input_dtype_casting`` does). With it the layer's output stays in the autocast dtype (base + adapter
    summed in bf16, as on a GPU); the residual stream stays float32 (it adds bf16 outputs to float32 embeddings).
    The maths of the matmuls is unchanged (autocast cast the same input to the same dtype); the sums and the
    elementwise ops between layers round to bf16 (gradient difference: docs/benchmarks.md).
    """
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or not isinstance(module, torch.nn.Module) \
                or type(module).__name__ == "ParamWrapper":  # LoRA on a fused expert weight, not on an input
            continue
        handle = getattr(module, "_scale_input_hook", None)
        if on and handle is None:
            module._scale_input_hook = module.register_forward_pre_hook(_adapter_input_hook)
            module.cast_input_dtype_enabled = False
            count += 1
        elif not on and handle is not None:
            _LAST_CAST[0] = None
            handle.remove()
            del module._scale_input_hook
            module.cast_input_dtype_enabled = True
            count += 1
    return count


def _addmm_adapter_forward(layer: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = layer.active_adapters[0] if len(layer.active_adapters) == 1 else None
    dev = x.device.type
    if (name is None or layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None
            or name not in layer.lora_A or name in getattr(layer, "lora_variant", {})
            or layer.lora_B[name].bias is not None or not torch.is_autocast_enabled(dev)):
        return type(layer).forward(layer, x, *args, **kwargs)  # peft's own forward
    result = layer.base_layer(x, *args, **kwargs)
    h = layer.lora_A[name](layer.lora_dropout[name](x))                            # [..., r]
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]),
                      layer.lora_B[name].weight.t(), alpha=layer.scaling[name])   # base + scaling * h @ B^T
    return out.view(result.shape)


def fuse_adapter_sum(model: torch.nn.Module, on: bool = True) -> int:
    """Under autocast, add each LoRA adapter's output to the base layer's in the adapter's second matmul: one
    ``addmm(base, h, B^T, alpha=scaling)`` instead of peft's ``base + lora_B(h) * scaling`` (a product, a scaling
    pass and a sum over ``[rows, out_features]``); return how many layers it touched.

    For one active plain adapter (no variant such as DoRA, no ``lora_B`` bias, not merged); anything else, and any
    forward outside autocast, runs peft's own forward. The sum is rounded once (oneDNN accumulates the product in
    float32 and adds the base in the same kernel) instead of three times; the gradients are autograd's of ``addmm``.
    """
    import types

    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or not isinstance(module, torch.nn.Module) \
                or type(module).__name__ == "ParamWrapper":  # LoRA on a fused expert weight, not on an input
            continue
        installed = "forward" in vars(module)
        if on and not installed:
            module.forward = types.MethodType(_addmm_adapter_forward, module)
            count += 1
        elif not on and installed:
            del module.forward
            count += 1
    return count


def _cached_cast_forward(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    dev = x.device.type
    w = head.weight
    if torch.is_autocast_enabled(dev) and not w.requires_grad and w.dtype == torch.float32:
        dtype = torch.get_autocast_dtype(dev)
        key = (w.data_ptr(), w._version, dtype)
        cached = getattr(head, "_scale_cast", None)
        if cached is None or cached[0] != key:
            cached = (key, w.detach().to(dtype))
            head._scale_cast = cached
        w = cached[1]
    return torch.nn.functional.linear(x, w, head.bias)


def cache_head_cast(model: torch.nn.Module, on: bool = True) -> bool:
    """Keep the autocast copy of a frozen ``nn.Linear`` LM head between forwards; return whether it changed.

    Autocast caches casts of leaf tensors that require grad only, so a frozen float32 head (tied to the embedding:
    ``[V, H]``, 28 M elements for SmolLM2) was cast to bf16 again in every forward (77 ms per micro-step on one
    thread). The copy is made once and made again when the weight changes (its data pointer or version); the
    product is bit-identical (autocast casts the same weight to the same dtype). Costs one bf16 copy of the head
    (56 MiB for SmolLM2). A head with LoRA or a trainable head is left alone.
    """
    import types

    head = _base(model).get_output_embeddings() if hasattr(_base(model), "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.requires_grad:
        return False
    installed = "forward" in vars(head)
    if on and not installed:
        head.forward = types.MethodType(_cached_cast_forward, head)
        return True
    if not on and installed:
        del head.forward
        head.__dict__.pop("_scale_cast", None)
        return True
    return False


def dequantize_in_compute_dtype(model: torch.nn.Module, on: bool = True) -> int:
    """Make bitsandbytes' 4-bit backward dequantize straight to the layer's compute dtype; return how many layers.

    ``MatMul4Bit.backward`` dequantizes the weight to its quantization state's dtype (the dtype the model was loaded
    in, float32) and casts the result to the gradient's dtype: a float32 ``[N, K]`` weight and a copy per layer and
    step. The forward already dequantizes straight to the compute dtype (``gemm_4bit``). Setting the state's dtype
    to the compute dtype gives bit-identical weights (the same kernel rounds the same float32 products; checked on
    the NF4 double-quantized ``[1536, 576]`` of SmolLM2: 0.24 instead of 0.57 ms per weight on one thread).
    ``on=False`` puts the load dtype back. Export dequantizes its own freshly loaded base (scale.export).
    """
    count = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        compute = getattr(module, "compute_dtype", None)
        if state is None or compute is None:
            continue
        if on and not hasattr(module, "_scale_load_dtype"):
            module._scale_load_dtype = state.dtype
            state.dtype = compute
            count += 1
        elif not on and hasattr(module, "_scale_load_dtype"):
            state.dtype = module._scale_load_dtype
            del module._scale_load_dtype
            count += 1
    return count


CPU_MIXED_PATHS = {"attention_fp32_short": use_mixed_sdpa, "adapter_inputs_cast_once": cast_adapter_inputs_once,
                   "adapter_sum_in_addmm": fuse_adapter_sum, "head_cast_cached": cache_head_cast,
                   "dequantize_to_compute_dtype": dequantize_in_compute_dtype}
"""The CPU mixed-precision paths by name (each ``fn(model, on) -> changed``), for :func:`use_cpu_mixed_paths` and
``benchmarks/bf16_paths.py``, which switches them one at a time."""


def use_cpu_mixed_paths(model: torch.nn.Module, names: Any = None, on: bool = True) -> list[str]:
    """Switch the CPU mixed-precision paths (:data:`CPU_MIXED_PATHS`, all when ``names`` is None) on or off; return
    the names of those that changed something on this model. Call it for a run that trains on CPU under bf16
    autocast, before ``prepare`` (``scale.job``)."""
    chosen = CPU_MIXED_PATHS if names is None else {n: CPU_MIXED_PATHS[n] for n in names}
    return [name for name, fn in chosen.items() if fn(model, on)]
