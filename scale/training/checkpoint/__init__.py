"""Resumable checkpoints: written atomically, verified, found again, checked against the config, loaded in any
launch mode. One file per concern: :mod:`~scale.training.checkpoint.store` (layout, list, verify, rotate, pick),
:mod:`~scale.training.checkpoint.rules` (the resume rules), :mod:`~scale.training.checkpoint.saving` (save and load),
:mod:`~scale.training.checkpoint.portable` (the state any launch mode loads),
:mod:`~scale.training.checkpoint.sharded` (full weights: every rank's ranges) and
:mod:`~scale.training.checkpoint.sharded_read` (read back by any layout). Import from here.
"""

from scale.training.checkpoint.portable import ADAPTER_FILE, derived_seed, rng_states, set_rng_states
from scale.training.checkpoint.rules import (adapt_to_checkpoint, check_fresh_start, check_resume, compare_configs,
                                             saved_precision)
from scale.training.checkpoint.saving import (load_checkpoint, register_hooks, save_adapter, save_checkpoint,
                                             save_model, unwrap)
from scale.training.checkpoint.store import (CheckpointError, clear_previous_run, list_checkpoints, model_files,
                                             pick_resume, record_files, resolve_resume, rotate, verify)

__all__ = ["ADAPTER_FILE", "CheckpointError", "adapt_to_checkpoint", "check_fresh_start", "check_resume",
           "clear_previous_run", "compare_configs", "derived_seed", "list_checkpoints", "load_checkpoint",
           "model_files", "pick_resume", "record_files", "register_hooks", "resolve_resume", "rng_states", "rotate", "save_adapter",
           "save_checkpoint", "save_model", "saved_precision", "set_rng_states", "unwrap", "verify"]
