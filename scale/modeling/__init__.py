"""The model a run trains: the tokenizer, the base (full precision or 4-bit), LoRA and gradient
checkpointing (:mod:`scale.modeling.build`); mixture-of-experts layouts (:mod:`scale.modeling.moe`); which attention
may run (:mod:`scale.modeling.attention`), packed rows' attention (:mod:`scale.modeling.varlen`), casts saved under
autocast (:mod:`scale.modeling.mixed_paths`), other kernels (:mod:`scale.modeling.kernels`), and the dropout it trains
with (:mod:`scale.modeling.dropout`).

Imports :mod:`scale.utils`, :mod:`scale.config` and :mod:`scale.loss`; never ``accelerate`` or
``torch.distributed``. This face hands on :mod:`scale.modeling.build`'s and :mod:`scale.modeling.dropout`'s names
(``from scale.modeling import load_tokenizer``) for scripts outside the package; modules inside import the module.
"""

from scale.modeling.build import (TINY, add_lora, bnb_config, build_model, check_lora_targets, checkpointing_kwargs,
                                  disable_cpu_inference_packing, freeze_in_load_dtype, full_numel,
                                  keep_bitsandbytes_out, linear_names, load_adapter, load_base, load_tokenizer,
                                  loading, needs_bitsandbytes, parameter_counts, reload_from_directory,
                                  restore_inference_config, tiny_llama_config, tokenizer_source)
from scale.modeling.dropout import Dropouts, disable_dropout, dropout_census

__all__ = ["TINY", "Dropouts", "add_lora", "bnb_config", "build_model", "check_lora_targets", "checkpointing_kwargs",
           "disable_cpu_inference_packing", "disable_dropout", "dropout_census", "freeze_in_load_dtype", "full_numel",
           "keep_bitsandbytes_out", "linear_names", "load_adapter", "load_base", "load_tokenizer", "loading",
           "needs_bitsandbytes", "parameter_counts", "reload_from_directory", "restore_inference_config",
           "tiny_llama_config", "tokenizer_source"]
