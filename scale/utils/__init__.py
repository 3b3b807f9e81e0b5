"""The ground floor every wing stands on: atomic file writes (:mod:`scale.utils.fileio`), the log format
(:mod:`scale.utils.logs`), pre-emption signals (:mod:`scale.utils.signals`), library APIs that moved between the
declared bounds (:mod:`scale.utils.compat`), FLOP counts (:mod:`scale.utils.flops`), the embedded real assets
(:mod:`scale.utils.assets`) and the model under its wrappers (:mod:`scale.utils.wrapped`).

Imports no other wing of ``scale``; never ``accelerate`` or ``torch.distributed``. Import the modules themselves
(this face hands nothing on: ``scale-train --help`` imports some of them without torch).
"""
