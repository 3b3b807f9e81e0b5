"""Load the base model (full precision or 4-bit), add LoRA, enable gradient checkpointing. No Accelerator.

``build_model(cfg.model, cfg.lora, ...)`` returns a ``peft.PeftModel`` whose only trainable parameters are
the LoRA matrices, or, under ``model.finetune=full``, the base with every weight trainable
(:mod:`scale.modeling.finetune`). Workarounds carry their reason and link:

- Gradient checkpointing goes through the model's own API with ``use_reentrant=False`` by default:
  re-entrant checkpointing breaks DDP + LoRA ("marked ready twice", peft#313, trl#921).
- Input-embedding outputs require grad when checkpointing a frozen base (peft#137), which transformers'
  transformers' checkpointing call does itself (:func:`scale.utils.compat.enable_checkpointing`: the API moved in 5.23).
- ``use_cache=False`` while training; :func:`restore_inference_config` puts it back before saving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scale.config.schema import LoraConfig, ModelConfig
from scale.config.validation import ConfigError
from scale.modeling import moe, moe_lora
from scale.modeling.finetune import make_full
from scale.modeling.tokens import add_tokens, grow_embeddings, peft_save_kwargs
from scale.utils.assets import EMBEDDED_MODEL, resolve_model
from scale.utils.compat import enable_checkpointing

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
    tok = copy.deepcopy(_TOKENIZERS[memo])
    add_tokens(tok, cfg)  # model.new_tokens / new_special_tokens
    return tok


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


def bnb_config(cfg: ModelConfig) -> Any:
    """The ``BitsAndBytesConfig`` for QLoRA (NF4, double quantization, compute and storage dtypes)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant,
        # "auto" is resolved at start-up (scale.training.precision.resolve_mixed_precision); unresolved it computes in
        # fp32
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
            if cfg.new_tokens or cfg.new_special_tokens:  # built for the tokenizer as it comes, grown like any model
                vocab_size = len(load_tokenizer(dataclasses.replace(cfg, new_tokens=[], new_special_tokens=[])))
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


def add_lora(model: torch.nn.Module, model_cfg: ModelConfig, lora_cfg: LoraConfig, grew: int | None = None
             ) -> torch.nn.Module:
    """Freeze the base, prepare k-bit training, enable checkpointing and wrap with a LoRA adapter.

    A mixture-of-experts model (fused 3-D experts) gets its targets from :mod:`scale.modeling.moe`: the linear layers by
    name and every expert's weights as peft ``target_parameters``, routers frozen unless ``lora.train_router``,
    ``lora.dropout`` on the linear layers' adapters only, the experts kept in their loaded dtype under 4-bit; its
    experts' LoRA computed as ``lora.expert_impl`` says (:func:`scale.modeling.moe_lora.choose_path`: split on the
    routed tokens, or peft's ``W + B A``).

    Returns:
        A ``peft.PeftModel``; only ``lora_A``/``lora_B`` require grad.

    Raises:
        ConfigError: ``lora.target_modules`` names a layer the model does not have; ``lora.expert_impl`` set on a
            dense model, or ``split`` where the split path cannot compute the experts.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    added = next((f"model.{k}={v}" for k, v in (("new_tokens", model_cfg.new_tokens),
                                                   ("new_special_tokens", model_cfg.new_special_tokens)) if v),
                 "the tokenizer's length")
    saved = peft_save_kwargs(model, lora_cfg, grew, added)  # lora.modules_to_save, checked (scale.modeling.tokens)
    layout = moe.moe_layout(model)  # None for a dense model
    loaded = {n: p.dtype for n, p in model.named_parameters()} if layout is not None else {}
    if model_cfg.quantize_4bit and model_cfg.qlora_residual_dtype == "compute":
        freeze_in_load_dtype(model)
    elif model_cfg.quantize_4bit:
        # Casts norms to fp32 and freezes the base. Checkpointing is enabled below, once, our way.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        if layout is not None:
            moe.restore_expert_dtype(model, layout, loaded)
    if model_cfg.gradient_checkpointing:
        # Also makes the embedding output require grad, so checkpointed blocks of a frozen base still
        # pass gradient to LoRA (peft#137).
        enable_checkpointing(model, **checkpointing_kwargs(model_cfg))
    if layout is not None:  # fused experts: explicit module and parameter names (scale.modeling.moe)
        targets = moe.lora_targets(layout, lora_cfg.target_modules, lora_cfg.train_router, linear_names(model))
        peft_cfg = PeftLoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, task_type="CAUSAL_LM",
                                  lora_dropout=0.0 if targets.parameters else lora_cfg.dropout,
                                  target_modules=targets.modules, target_parameters=targets.parameters or None,
                                  **saved)
        with moe.explicit_targets():
            model = get_peft_model(model, peft_cfg)
        if targets.parameters:
            moe.set_linear_dropout(model, lora_cfg.dropout)
            moe_lora.choose_path(model, layout.experts, lora_cfg.expert_impl)
        return model
    if lora_cfg.expert_impl is not None:
        raise ConfigError(f"lora.expert_impl={lora_cfg.expert_impl} applies to mixture-of-experts models; this model "
                          f"is dense: drop the key (null)")
    check_lora_targets(model, lora_cfg.target_modules)
    peft_cfg = PeftLoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        task_type="CAUSAL_LM",
        **saved,
    )
    return get_peft_model(model, peft_cfg)


def freeze_in_load_dtype(model: torch.nn.Module) -> None:
    """Freeze every base weight and leave the unquantized ones (embeddings, norms, head) in the dtype they were
    loaded in: ``model.qlora_residual_dtype: compute``, in place of peft's ``prepare_model_for_kbit_training``.

    peft casts every bf16/fp16 weight that is not 4-bit to float32 (QLoRA, Dettmers et al. 2023,
    arXiv:2305.14314, keeps the norms in float32); the float32 embeddings then keep the residual stream, and every
    residual add and norm around the 4-bit GEMMs, in float32 under bf16 autocast, with a cast at each layer's input
    and output. Left in bf16 (what TRL's ``SFTTrainer`` does with a 4-bit model: it does not call
    ``prepare_model_for_kbit_training``), the stream is bf16 as in a bf16 LoRA run; the norms still compute in
    float32 inside (``LlamaRMSNorm`` upcasts its input). Loss and gradient differences against the float32 upcast
    and against a float32 model: docs/benchmarks.md and tests/test_mixed_paths.py. Checkpointing's input-gradient
    hook is added by :func:`scale.utils.compat.enable_checkpointing`, as for the float32 path.
    """
    for p in model.parameters():
        p.requires_grad = False


def checkpointing_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Arguments of :func:`scale.utils.compat.enable_checkpointing` for ``model.gradient_checkpointing``:
    ``true`` every layer, ``every_n`` every ``checkpoint_every_n_layers``-th layer, ``offload`` every layer with
    the saved layer inputs in (pinned) host memory (``torch.autograd.graph.save_on_cpu``). Without a GPU the
    activations already live in host memory and transformers 5.24's offload fails on CPU ("pin_memory=True
    requires a CUDA or other accelerator backend"), so ``offload`` checkpoints every layer there, as ``true``."""
    return {"activation_checkpointing_kwargs": {"use_reentrant": cfg.use_reentrant},
            "every_n_layers": cfg.checkpoint_every_n_layers if cfg.gradient_checkpointing == "every_n" else 1,
            "offload": cfg.gradient_checkpointing == "offload" and torch.cuda.is_available()}


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
    """The model ready for training, as ``model.finetune`` says: ``lora``: base + LoRA (weights initialised from
    ``seed``); ``full``: the base with every weight trainable (:func:`scale.modeling.finetune.make_full`).

    Args:
        model_cfg: the model section.
        lora_cfg: the lora section (unread under ``full``).
        vocab_size: the tokenizer's length: ``tiny-llama``'s rows; shorter embeddings grow to it (as transformers
            resizes: :func:`scale.modeling.tokens.grow_embeddings`), before LoRA wraps the model.
        seed: RNG seed for tiny weights and LoRA init.
        device_map: per-rank device for 4-bit loading.

    Returns:
        The PEFT model (``lora``) or the transformers model (``full``), in train mode.
    """
    base = load_base(model_cfg, vocab_size, seed, device_map)
    grew = grow_embeddings(base, vocab_size, seed, load_tokenizer(model_cfg).vocab_size)  # added tokens only
    if model_cfg.finetune == "full":
        return make_full(base, checkpointing_kwargs(model_cfg) if model_cfg.gradient_checkpointing else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = add_lora(base, model_cfg, lora_cfg, grew)
    if model_cfg.adapter is not None:
        load_adapter(model, model_cfg.adapter, lora_cfg)
    model.train()
    return model


def load_adapter(model: torch.nn.Module, path: str, lora_cfg: LoraConfig) -> None:
    """Load a saved peft adapter's weights (``adapter_model.safetensors`` of ``path``) into ``model``'s ``default``
    adapter (``model.adapter``: continue an SFT run's adapter).

    Raises:
        ValueError: ``path`` holds no adapter, its rank/alpha/targets differ from ``lora.*`` (named), or its
            weights do not fit the model (missing or unexpected LoRA tensors).
    """
    import json

    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"model.adapter={path} holds no adapter_config.json; point it at a saved peft adapter "
                         f"directory (an SFT run's <output_dir>/adapter)")
    saved = json.loads(config_file.read_text(encoding="utf-8"))
    targets = lora_cfg.target_modules if isinstance(lora_cfg.target_modules, str) else sorted(lora_cfg.target_modules)
    saved_targets = saved.get("target_modules")
    saved_targets = saved_targets if isinstance(saved_targets, str) else sorted(saved_targets or [])
    wanted = {"lora.r": (lora_cfg.r, saved.get("r")), "lora.alpha": (lora_cfg.alpha, saved.get("lora_alpha"))}
    for key, (ours, theirs) in wanted.items():
        if theirs is not None and float(ours) != float(theirs):
            raise ValueError(f"model.adapter={path} was saved with {key}={theirs}, this run has {key}={ours}; set "
                             f"{key}={theirs}")
    if targets != "all-linear" and saved_targets != targets:
        raise ValueError(f"model.adapter={path} adapts {saved_targets}, lora.target_modules is {targets}; set "
                         f"lora.target_modules to the adapter's")
    result = set_peft_model_state_dict(model, load_peft_weights(str(path)))
    lora_keys = [k for k in model.state_dict() if "lora_" in k and ".default." in k]
    if result.unexpected_keys or not lora_keys:
        raise ValueError(f"model.adapter={path}: its tensors do not fit this model ({len(result.unexpected_keys)} "
                         f"unexpected, e.g. {result.unexpected_keys[:2]}); was it trained on model.name_or_path?")


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
