"""The data side of ``scale``, one module per stage; each stage imports only the stages before it:

read (files -> rows of cells) -> sources (any source -> rows) -> tasks (one module per format: rows -> checked
rows and their tokens) -> split (train/eval rows of one source) -> mixing (one source or several by weight) ->
tokenize (rows -> :class:`Splits` of examples) -> token_table, cache (the memory-mapped token cache) -> collate
(batches: padded, padding-free, packed) and order (length-grouped sampling, packing into bins).

The names other modules (and scripts written against ``scale.data``) import are handed on from here.

Imports utils, config and loss; never ``accelerate`` or ``torch.distributed``.
"""

from scale.data.collate import Collator, PackedCollator, PaddingFreeCollator
from scale.data.read import DataError
from scale.data.split import split_rows
from scale.data.tasks import load_rows
from scale.data.tasks.base import Example, special_affixes
from scale.data.tasks.chat_spans import render_chat
from scale.data.tasks.chat_template import chat_template
from scale.data.tasks.classification import label_candidates, label_sequences, label_token_ids, render_template
from scale.data.tokenize import (Splits, build_splits, removed_lines, show_example, show_legend, stats_line,
                                 tokenize_rows)

__all__ = ["Collator", "DataError", "Example", "PackedCollator", "PaddingFreeCollator", "Splits", "build_splits",
           "chat_template", "label_candidates", "label_sequences", "label_token_ids", "load_rows", "render_chat",
           "removed_lines", "render_template", "show_example", "show_legend", "special_affixes", "split_rows",
           "stats_line", "tokenize_rows"]
