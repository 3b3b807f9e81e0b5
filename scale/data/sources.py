"""Sources: any data source -> rows (dicts) and their column names. No tokenizer, no torch.

``data.path`` (and ``data.eval_path``) may name:

| source | read by |
|---|---|
| a ``.jsonl/.json/.csv/.tsv`` file | the strict readers of :mod:`scale.data.read` (row-numbered errors, ``NA`` stays text) |
| a ``.parquet`` or ``.arrow`` file | Hugging Face ``datasets`` (``load_dataset("parquet"/"arrow")``) |
| a ``save_to_disk`` directory | ``datasets.load_from_disk``; a ``DatasetDict`` gives ``data.split`` |
| a directory of shards, or a glob (``shards/*.parquet``) | every matching file in sorted order, one format |
| a hub id ``org/name`` | ``datasets.load_dataset(id, data.subset, split=data.split)``; offline: one line saying so |

Rows are numbered from 0 across the shards in sorted order (the row number names a row in error messages).
:func:`source_digest` hashes what a source holds (the data-changed guard on resume, the token cache's key;
the digest of a whole data config, one source or a mixture, is :func:`scale.data.mixing.data_digest`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from scale.data.read import DataError, FileRows, columns_of, read_table
from scale.utils.assets import resolve_data
from scale.utils.fileio import sha256_file

TABLE_EXTENSIONS = (".csv", ".json", ".jsonl", ".tsv")   # scale.data.read's strict readers
ARROW_EXTENSIONS = (".parquet", ".arrow")                 # read through datasets
_HUB_ID = re.compile(r"^[\w\-.]{1,96}/[\w\-.]{1,96}$")     # huggingface_hub's repo-id shape
_GLOB = re.compile(r"[*?\[]")


def is_save_to_disk(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def source_kind(path: str) -> str:
    """What ``path`` names: ``table`` (a strict-reader file), ``arrow`` (a .parquet/.arrow file), ``disk`` (a
    ``save_to_disk`` directory), ``shards`` (a directory or glob of files), ``hub`` or ``missing``."""
    p = Path(path).expanduser()
    if p.is_file():
        return "arrow" if p.suffix.lower() in ARROW_EXTENSIONS else "table"
    if is_save_to_disk(p):
        return "disk"
    if p.is_dir() or _GLOB.search(path):
        return "shards"
    if _HUB_ID.match(path) and not path.startswith((".", "~", "/")) and not p.suffix.lower() in \
            TABLE_EXTENSIONS + ARROW_EXTENSIONS:
        return "hub"
    return "missing"


def shard_files(path: str) -> list[Path]:
    """The data files of a directory (recursively) or a glob, sorted by path; hidden files are skipped.

    Raises:
        DataError: no file matches, or the files mix extensions.
    """
    p = Path(path).expanduser()
    found = sorted(p.rglob("*")) if p.is_dir() else sorted(Path(f) for f in glob.glob(str(p), recursive=True))
    files = [f for f in found if f.is_file() and not any(part.startswith((".", "_")) for part in f.parts[-1:])
             and f.suffix.lower() in TABLE_EXTENSIONS + ARROW_EXTENSIONS]
    if not files:
        raise DataError(f"data.path={path!r} holds no {'/'.join(TABLE_EXTENSIONS + ARROW_EXTENSIONS)} file; point "
                        f"it at a data file, a directory or glob of shards, a save_to_disk directory or a hub id")
    kinds = sorted({f.suffix.lower() for f in files})
    if len(kinds) > 1:
        raise DataError(f"data.path={path!r} mixes file types {kinds}; give one type of shard (a glob such as "
                        f"{path.rstrip('/')}/*{kinds[0]}), or list them as data.datasets")
    return files


def read_source(cfg: Any, path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Read any source (see the module docstring) into rows and column names.

    Args:
        cfg: the data section (``split``, ``subset``, ``column_names``).
        path: file, directory, glob or hub id.

    Returns:
        ``(rows, columns)``: rows as dicts in source order, every column a row has (:func:`columns_of`).

    Raises:
        DataError: a missing source, an unreadable file, a split that does not exist, or an unreachable hub
            (one line, no traceback).
    """
    kind = source_kind(path)
    if kind == "table":
        return read_table(cfg, path)
    if cfg.column_names is not None and kind != "shards":
        raise DataError("data.column_names applies to header-less .csv/.tsv files only; remove it")
    if kind == "arrow":
        rows = _rows(_load_files([Path(path).expanduser()], path))
    elif kind == "disk":
        rows = _rows(_load_disk(cfg, path))
    elif kind == "shards":
        files = shard_files(path)
        if files[0].suffix.lower() in TABLE_EXTENSIONS:
            rows, lines, starts = FileRows(), [], []
            for f in files:
                part = read_table(cfg, str(f))[0]
                starts.append((len(rows), f.name))
                rows.extend(part)
                lines = None if lines is None or part.lines is None else lines + part.lines
            rows.lines, rows.files = lines, starts
        else:
            rows = _rows(_load_files(files, path))
    elif kind == "hub":
        rows = _rows(_load_hub(cfg, path))
    elif Path(path).suffix.lower() in TABLE_EXTENSIONS:
        return read_table(cfg, path)  # its own message for a missing file
    else:
        raise DataError(f"data.path={path!r} does not exist; point it at a data file (.jsonl/.json/.csv/.tsv/"
                        f".parquet/.arrow), a directory or glob of shards, a save_to_disk directory or a hub id "
                        f"org/name (a relative path is read from the current directory, {os.getcwd()})")
    if not rows:
        raise DataError(f"data.path={path!r} has no rows")
    return rows, columns_of(rows) if isinstance(rows, FileRows) else list(rows[0])  # a table's rows share columns


def _rows(ds: Any) -> list[dict[str, Any]]:
    """A ``datasets.Dataset`` as a list of dicts, read column-wise (one pass per column, not one per row)."""
    columns = ds.column_names
    data = ds.to_dict() if len(ds) else {c: [] for c in columns}
    return [dict(zip(columns, values)) for values in zip(*(data[c] for c in columns))]


def _load_files(files: list[Path], path: str) -> Any:
    datasets = _datasets()
    builder = "parquet" if files[0].suffix.lower() == ".parquet" else "arrow"
    drift = _shard_difference(files, coarse=True) if len(files) > 1 else None
    if drift:
        raise DataError(f"data.path={path!r}: {drift}; give every shard the same columns and types, or list the "
                        f"shards as data.datasets entries")
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                     cache_dir=str(Path(_hf_cache()) / "sources"))
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow raise many types for one unreadable file
        differs = _shard_difference(files) if len(files) > 1 else None
        if differs:
            raise DataError(f"data.path={path!r}: {differs}; give every shard the same columns and types, or list "
                            f"the shards as data.datasets entries (each with its own *_column keys)") from None
        raise DataError(f"data.path={path!r} cannot be read as {builder} ({type(e).__name__}: "
                        f"{_first_line(e)})") from e


def _schema(f: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.suffix.lower() == ".parquet":
        return pq.read_schema(str(f))
    with pa.memory_map(str(f)) as source:  # datasets writes .arrow files as IPC streams; files work too
        try:
            return pa.ipc.open_stream(source).schema
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).schema


def _kind(t: Any) -> str | None:
    """A column type's kind: text, number, bool, list or struct (``None`` for all-null: matches any)."""
    import pyarrow.types as pt

    for kind, test in (("text", lambda x: pt.is_string(x) or pt.is_large_string(x)),
                       ("number", lambda x: pt.is_integer(x) or pt.is_floating(x)), ("bool", pt.is_boolean),
                       ("list", lambda x: pt.is_list(x) or pt.is_large_list(x)), ("struct", pt.is_struct)):
        if test(t):
            return kind
    return None if pt.is_null(t) else str(t)


def _shard_difference(files: list[Path], coarse: bool = False) -> str | None:
    """The first shard whose columns (or a column's type) differ from the first shard's, in words; ``None`` when
    every schema matches or one cannot be read (the caller then reports the reader's own error).

    A column of all-null values in one shard matches any type (the reader unifies it). ``coarse``: column types
    only by kind (text against a number, :func:`_kind`: the reader would cast an integer label to the text '1'
    without a word); other type differences are left to the reader and diagnosed when it fails. Column names
    must match either way (the reader refuses a shard with an extra column but fills a missing one with nulls).
    """
    try:
        first, *rest = [(f, _schema(f)) for f in files]
    except Exception:  # noqa: BLE001 - an unreadable file: the reader's error says more
        return None
    f0, s0 = first
    for f, s in rest:
        if s.names != s0.names:
            extra = [c for c in s.names if c not in s0.names]
            missing = [c for c in s0.names if c not in s.names]
            what = (f"the column(s) {extra} that {f0.name} lacks" if extra else "") + (
                " and " if extra and missing else "") + (f"no column(s) {missing}" if missing else "")
            return (f"shard {f.name} has {what or 'its columns in another order'} (its columns {s.names}, "
                    f"{f0.name}'s {s0.names})")
        for name in s0.names:
            a, b = s0.field(name).type, s.field(name).type
            differ = _kind(a) != _kind(b) if coarse else a != b
            if differ and None not in (_kind(a), _kind(b)):
                return f"column {name!r} is {b} in shard {f.name} but {a} in {f0.name}"
    return None


def _load_disk(cfg: Any, path: str) -> Any:
    datasets = _datasets()
    try:
        ds = datasets.load_from_disk(str(Path(path).expanduser()))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"data.path={path!r} cannot be read as a save_to_disk directory ({type(e).__name__}: "
                        f"{_first_line(e)})") from e
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise DataError(f"data.split={cfg.split!r} is not a split of {path}; its splits are {list(ds)}")
        ds = ds[cfg.split]
    return ds


def _load_hub(cfg: Any, path: str) -> Any:
    datasets = _datasets()
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on") or \
            os.environ.get("HF_DATASETS_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        where = "offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)"
    else:
        where = "unreachable"
    try:
        return datasets.load_dataset(path, cfg.subset, split=cfg.split, cache_dir=_hf_cache())
    except Exception as e:  # noqa: BLE001 - connection, auth and missing-split errors all become one line
        raise DataError(f"data.path={path!r} is not a local file or directory, so it was read as a hub data set, "
                        f"and that failed: {type(e).__name__}: {_first_line(e)} (the hub is {where}"
                        f"{'' if where != 'unreachable' else ' or the id, data.subset or data.split is wrong'}). "
                        f"Download it where the hub is reachable (datasets' save_to_disk) and point data.path "
                        f"at that directory") from e


def _datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _hf_cache() -> str:
    return os.environ.get("HF_DATASETS_CACHE", str(Path.home() / ".cache" / "huggingface" / "datasets"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def eval_source_of(data_cfg: Any, path: str) -> tuple[Any, str] | None:
    """``(config, source)`` of the eval rows when ``data.eval_path`` or ``data.eval_split`` is set, else ``None``
    (the eval rows are carved out of ``path``)."""
    if data_cfg.eval_path is None and data_cfg.eval_split is None:
        return None
    cfg = replace(data_cfg, split=data_cfg.eval_split or data_cfg.split)
    return cfg, resolve_data(data_cfg.eval_path) if data_cfg.eval_path is not None else path


def source_digest(cfg: Any, path: str) -> str:
    """A hex sha256 of what ``path`` holds: a file's own sha256 (as :func:`scale.utils.fileio.sha256_file`, so the
    data-changed guard of checkpoints written before sources existed still matches), a directory's or glob's
    relative paths and file hashes, or a hub id with its subset, split and resolved revision.

    Raises:
        DataError: see :func:`shard_files`.
    """
    kind = source_kind(path)
    p = Path(path).expanduser()
    if kind in ("table", "arrow"):
        return file_sha256(p)
    h = hashlib.sha256()
    if kind in ("disk", "shards"):
        files = sorted(f for f in p.rglob("*") if f.is_file()) if kind == "disk" else shard_files(path)
        base = p if p.is_dir() else Path(os.path.commonpath([str(f.parent) for f in files]))
        for f in files:
            h.update(f"{f.relative_to(base).as_posix()}\0{file_sha256(f)}\n".encode())
        return h.hexdigest()
    h.update(json.dumps({"hub": path, "subset": cfg.subset, "split": cfg.split, "revision": _hub_revision(path)},
                        sort_keys=True).encode())
    return h.hexdigest()


_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """``sha256_file``, remembered in this process per (path, inode, size, mtime): the fingerprint and the
    resume guard hash each data file once per start, not twice."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


def _hub_revision(path: str) -> str:
    """The commit the hub id resolves to now, or ``"unknown"`` offline (then the cache key is the id alone)."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(path).sha or "unknown"
    except Exception:  # noqa: BLE001 - offline or private
        return "unknown"

