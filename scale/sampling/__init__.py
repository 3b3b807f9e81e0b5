"""An alias package kept for scripts written against ``scale.sampling``: the sampler and packing moved to
:mod:`scale.data.order`, the collators to :mod:`scale.data.collate`. New code imports them there. (A package,
not a module file, so that git follows ``scale/sampling.py`` to ``scale/data/order.py``.)"""

from scale.data.collate import PackedCollator, PaddingFreeCollator
from scale.data.order import LengthGroupedSampler, PackedRows, length_grouped_order, pack_bfd, pad_fraction

__all__ = ["LengthGroupedSampler", "PackedCollator", "PackedRows", "PaddingFreeCollator", "length_grouped_order",
           "pack_bfd", "pad_fraction"]
