"""The parts of a run, each building itself from the config in its own module, in the order
:func:`scale.job.setup` lists them: :mod:`~scale.parts.launch` (accelerator, mode plan, precision, the resume
checked), :mod:`~scale.parts.data` (tokenizer, token cache), :mod:`~scale.parts.model`, :mod:`~scale.parts.loaders`,
:mod:`~scale.parts.optimizer`, :mod:`~scale.parts.resume` (resume or start), :mod:`~scale.parts.log` (metrics,
trackers, generated samples); for a mixture-of-experts model :mod:`~scale.parts.experts` (what trains, the tokens per
expert, the load-balancing loss). The start-up report is :mod:`scale.startup`.
"""
