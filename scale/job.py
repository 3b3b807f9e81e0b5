"""Kept for scripts outside the package that import ``scale.job``: the module is :mod:`scale.training.job`. Nothing
inside ``scale`` imports this one."""

from scale.training.job import Job, make_optimizer, setup

__all__ = ["Job", "make_optimizer", "setup"]
