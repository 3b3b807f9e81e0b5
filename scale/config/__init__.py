"""The config: what a run is. The schema (:mod:`scale.config.schema`, every key with its default and unit),
its rules (:mod:`scale.config.validation`, :class:`~scale.config.validation.ConfigError`), YAML files and dotted
overrides (:mod:`scale.config.load`), the reference generated from the schema (:mod:`scale.config.help`) and other
tools' names for its keys (:mod:`scale.config.names`).

Imports only :mod:`scale.utils`; no torch. This face hands on :mod:`scale.config.load`'s names
(``from scale.config import load_config``) for scripts outside the package; modules inside import the module.
"""

from scale.config.load import (DEFAULT_CONFIG, FILE_KEYS, PATH_KEYS, YamlLoader, configs_dir, dump_config,
                               load_config, named_config, redact, redact_field, to_dict, unknown_keys_message,
                               yaml_load)

__all__ = ["DEFAULT_CONFIG", "FILE_KEYS", "PATH_KEYS", "YamlLoader", "configs_dir", "dump_config", "load_config",
           "named_config", "redact", "redact_field", "to_dict", "unknown_keys_message", "yaml_load"]
