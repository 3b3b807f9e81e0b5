"""The parts of a run, each building itself from the config in its own module, in the order
:func:`scale.training.job.setup` lists them: :mod:`~scale.training.parts.launch` (accelerator, mode plan, precision, the
resume checked), :mod:`~scale.training.parts.data` (tokenizer, token cache), :mod:`~scale.training.parts.model`,
:mod:`~scale.training.parts.loaders`, :mod:`~scale.training.parts.optimizer`, :mod:`~scale.training.parts.resume`
(resume or start), :mod:`~scale.training.parts.log` (metrics, trackers, generated samples); for a mixture-of-experts
model :mod:`~scale.training.parts.experts` (what trains, the tokens per expert, the load-balancing loss). The start-up
report is :mod:`scale.training.startup`.
"""
