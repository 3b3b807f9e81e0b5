"""Generation with a trained model: the serving files a run ships and its merged export
(:mod:`scale.generation.export`: the tokenizer with the trained chat template and end-of-turn stop, LoRA folded into
the base), and answering as the run trained (:mod:`scale.generation.generator`: loading, prompts rendered by the
run's template, ``model.generate`` with a :class:`~scale.generation.generator.Sampling`). ``scale-export`` and
``scale-generate`` (:mod:`scale.export`, :mod:`scale.generate`) are their command lines.

Imports utils, config, loss, data, modeling and objectives; never ``accelerate`` or ``torch.distributed``. This face
hands nothing on: import the modules.
"""
