"""An alias package kept for scripts written against ``scale.formats``: the file readers moved to
:mod:`scale.data.read`, the format registry to :mod:`scale.data.tasks`. New code imports them there. (A package,
not a module file, so that git follows ``scale/formats.py`` to ``scale/data/read.py``.)"""

from scale.data.read import DataError, normalize_label, read_table, row_key
from scale.data.tasks import FORMATS, columns_needed, detect_format, load_rows

__all__ = ["FORMATS", "DataError", "columns_needed", "detect_format", "load_rows", "normalize_label", "read_table",
           "row_key"]
