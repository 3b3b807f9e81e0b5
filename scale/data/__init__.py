"""The data side of ``scale``: rows -> token sequences with a trained tail -> batches (see :mod:`scale.data.tokenize`).

The entry points other modules (and scripts written against ``scale.data``) import are handed on from here.
"""

from scale.data.tokenize import (
                                 Collator,
                                 DataError,
                                 Example,
                                 Splits,
                                 build_splits,
                                 chat_template,
                                 label_candidates,
                                 label_sequences,
                                 label_token_ids,
                                 load_rows,
                                 render_chat,
                                 render_template,
                                 show_example,
                                 show_legend,
                                 special_affixes,
                                 split_rows,
                                 tokenize_rows,
)

__all__ = ["Collator", "DataError", "Example", "Splits", "build_splits", "chat_template", "label_candidates",
           "label_sequences", "label_token_ids", "load_rows", "render_chat", "render_template", "show_example",
           "show_legend", "special_affixes", "split_rows", "tokenize_rows"]
