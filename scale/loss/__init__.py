"""The loss maths on plain tensors: cross-entropy over each row's tail and the forwards that feed it
(:mod:`scale.loss.tail`), and the same loss a chunk of the tail at a time (:mod:`scale.loss.chunked`). The
objectives (:mod:`scale.objectives`) are built on it; the data formats and the model's packed-row attention read
its batch keys.

Imports only :mod:`scale.utils` and :mod:`scale.config`; never ``accelerate`` or ``torch.distributed``. This face
hands on :mod:`scale.loss.tail`'s names (``from scale.loss import forward_tail``) for scripts outside the package;
modules inside import the module.
"""

from scale.loss.tail import (CRITERION_MODE, PACKED_SEQ_LENS, SEGMENTS_SUFFIX, SHARD_KEY, Criterion, TailBatch,
                             bad_rows, batch_bad_rows, bind_criterion, check_rows, describe_bad_row,
                             describe_batch_row, forward_tail, forward_tail_packed, forward_tail_shard,
                             load_criterion, packed_kwargs, select_tail_logits, tail_batch, tail_lengths, tail_loss,
                             tail_positions, token_weights)

__all__ = ["CRITERION_MODE", "PACKED_SEQ_LENS", "SEGMENTS_SUFFIX", "SHARD_KEY", "Criterion", "TailBatch", "bad_rows",
           "batch_bad_rows", "bind_criterion", "check_rows", "describe_bad_row", "describe_batch_row", "forward_tail",
           "forward_tail_packed", "forward_tail_shard", "load_criterion", "packed_kwargs", "select_tail_logits",
           "tail_batch", "tail_lengths", "tail_loss", "tail_positions", "token_weights"]
