"""Every rank's random-number generator states, saved and restored."""
import random
from typing import Callable, Optional

import numpy as np
import torch

from mmpar import device
from mmpar.dist import all_gather_objects


def rng_state() -> dict:
    """This process's random-number generator states (Python, NumPy, torch
    and, once the accelerator is in use, each of its devices, keyed by
    its type: ``'cuda'`` as before)."""
    state = dict(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch=torch.get_rng_state())
    state.update(device.rng_states())
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (also after :func:`to_plain`
    and a weights-only load, which turn NumPy's array into a list)."""
    version, internal, gauss = state['python']
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state['numpy']
    np.random.set_state(
        (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state['torch'])
    device.set_rng_states(state)


def all_rng_states() -> list:
    """Every rank's :func:`rng_state`, in rank order (a collective when
    distributed: every rank must call it)."""
    return all_gather_objects(rng_state())


def restore_rng_states(states: Optional[list], rank: int, world_size: int,
                       warn: Callable[[str], None] = print) -> bool:
    """Give rank ``rank`` its saved generator states; False (and one
    ``warn`` call) when there are none or they come from another world size.
    """
    if not states:
        return False
    if len(states) != world_size:
        warn(f'the checkpoint holds RNG states of {len(states)} ranks and '
             f'this run has {world_size}: random number generators are not '
             'restored')
        return False
    set_rng_state(states[rank])
    return True
