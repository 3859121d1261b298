"""Gradient hooks that do not keep their model alive.

Autograd keeps a tensor's hooks in C++, where Python's cycle collector does
not look. A hook that holds its owner (a wrapper, whose module holds the
parameter) closes a cycle the collector cannot break, and torch's
multi-grad hook holds the parameters' grad accumulators, which hold the
parameters: either keeps the model, its gradients and buckets alive after
the last reference to the wrapper is gone (every layout-search trial of a
wrapper so left its model behind; docs/layout_search.md). So the owner's
hooks hold it weakly (:func:`weak_hook`) and are removed when it is
collected (:func:`remove_when_collected`).
"""
import weakref
from typing import Callable, List


def weak_hook(owner, method: str, *args) -> Callable:
    """A hook calling ``owner.<method>(*args, *hook_args)`` while ``owner``
    lives (a no-op after), holding ``owner`` weakly."""
    ref = weakref.ref(owner)

    def hook(*hook_args):
        live = ref()
        if live is not None:
            getattr(live, method)(*args, *hook_args)

    return hook


def remove_hooks(handles: List) -> None:
    """Remove every hook of ``handles`` and empty the list."""
    for handle in handles:
        handle.remove()
    handles.clear()


def remove_when_collected(owner, handles: List) -> List:
    """Remove ``handles`` (the list, as it is then) once ``owner`` is
    collected; returns ``handles``."""
    weakref.finalize(owner, remove_hooks, handles)
    return handles
