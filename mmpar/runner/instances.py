"""Forgetting one experiment's MMEngine instances.

MMEngine keeps a logger, a message hub, a visualizer and a default scope
per experiment name, in class-level registries (``ManagerMixin``), for the
life of the process. A process that runs many short experiments (the
layout search's trials, one per candidate) would keep every one of them,
with the logger's open log file, the hub's logged scalars and runtime info.
"""
import logging

from mmengine.utils import ManagerMixin
from mmengine.visualization import Visualizer


def _managed_classes(cls=ManagerMixin):
    for sub in cls.__subclasses__():
        yield sub
        yield from _managed_classes(sub)


def forget_experiment(name: str) -> None:
    """Drop every MMEngine instance registered under ``name`` (MMLogger,
    MessageHub, Visualizer, DefaultScope and other ``ManagerMixin``
    classes), closing the logger's handlers and the visualizer's backends;
    the current instance becomes the one registered before it."""
    for cls in _managed_classes():
        # No public way to remove an instance in MMEngine 0.10.
        instance = cls._instance_dict.pop(name, None)
        if isinstance(instance, logging.Logger):
            for handler in list(instance.handlers):
                instance.removeHandler(handler)
                handler.close()
        elif isinstance(instance, Visualizer):
            instance.close()
