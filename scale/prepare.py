"""``scale-prepare``: build the token cache of a config ahead of the training job (on a CPU node).

    scale-prepare --config configs/train/sft.yaml data.num_proc=32
    scale-train --config configs/train/sft.yaml          # the same fingerprint: memory-maps the cache, no tokenizing

Prints one line: the cache entry, whether it was built or found, the rows and tokens of each split. Exit codes as
``scale-train``: 0 done, 2 the config or the data was rejected (one line on stderr naming the fix).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from scale.config.help import help_text
from scale.config.load import load_config
from scale.config.validation import ConfigError
from scale.data.cache import default_cache_dir, fingerprint, load_splits
from scale.data.read import DataError
from scale.data.token_table import column
from scale.modeling.build import load_tokenizer
from scale.utils.assets import resolve_data
from scale.utils.logs import configure_logging

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, build (or find) the cache; return the exit code."""
    parser = argparse.ArgumentParser(prog="scale-prepare", description=help_text(__doc__.split("\n")[0]))
    parser.add_argument("--config", default=None, help="train config file or shipped name (default: default)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, as scale-train takes them")
    args = parser.parse_args(argv)
    configure_logging(dict(os.environ))  # scale-train's line format and third-party notice handling
    start = time.perf_counter()
    try:
        cfg = load_config(args.config, args.overrides)
        if not cfg.data.cache:
            raise ConfigError("data.cache=false: there is no cache to prepare; drop the override")
        tokenizer = load_tokenizer(cfg.model)
        path = cfg.data.path if cfg.data.datasets else resolve_data(cfg.data.path)  # data.datasets: not read
        splits = load_splits(cfg, tokenizer, path)
    except (ConfigError, DataError) as e:
        sys.stderr.write(f"scale-prepare: error: {type(e).__name__}: {e}\n")
        return EXIT_BAD_INPUT
    key, _ = fingerprint(cfg, tokenizer, path)
    tokens = {name: int(column(part, "length").sum()) for name, part in (("train", splits.train),
                                                                         ("eval", splits.eval))}
    sys.stdout.write(f"scale-prepare: {default_cache_dir(cfg) / key[:32]} format={splits.format} "
                     f"train_rows={len(splits.train)} eval_rows={len(splits.eval)} train_tokens={tokens['train']} "
                     f"eval_tokens={tokens['eval']} seconds={time.perf_counter() - start:.1f}\n")
    return 0


def cli() -> None:
    """Console entry point (``scale-prepare``)."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
