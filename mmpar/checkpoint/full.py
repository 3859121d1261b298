"""The ``full`` checkpoint format: one file with the plain model's state.

Every rank builds it (sharded wrappers gather their state, a collective);
the caller writes it from rank 0 (:func:`mmpar.checkpoint.files.atomic_save`).
"""
from typing import Optional

from mmengine.optim import OptimWrapper
from mmengine.runner.checkpoint import weights_to_cpu
from torch import nn

from mmpar.checkpoint.files import to_cpu
from mmpar.checkpoint.state import model_state, optimizer_state


def collect_checkpoint(model: nn.Module,
                       optim_wrapper: Optional[OptimWrapper],
                       extras: dict,
                       save_optimizer: bool = True) -> dict:
    """``extras`` plus ``state_dict`` and (optionally) ``optimizer``, on CPU.

    Args:
        model: the (wrapped) model.
        optim_wrapper: its optim wrapper; needed with ``save_optimizer``.
        extras: ``meta``, ``message_hub``, schedulers, RNG states; copied.
        save_optimizer: also save the optimizer state.

    Raises:
        TypeError: ``save_optimizer`` without an ``OptimWrapper``.
    """
    checkpoint = dict(extras)
    checkpoint['state_dict'] = weights_to_cpu(model_state(model))
    if save_optimizer:
        if not isinstance(optim_wrapper, OptimWrapper):
            raise TypeError('optim_wrapper must be an OptimWrapper, '
                            f'got {type(optim_wrapper).__name__}')
        checkpoint['optimizer'] = to_cpu(optimizer_state(model, optim_wrapper))
    return checkpoint

