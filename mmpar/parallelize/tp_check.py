"""A tensor-parallel plan's first forward, dry-run on the meta device.

A plan can split a layer into shapes the model's own code does not accept:
``attn.qkv: colwise`` on timm's attention (one ``qkv`` Linear reshaped to
``(B, N, 3, heads, head_dim)``) leaves each rank a third of the features it
reshapes, and the model dies deep inside its forward with a shape error that
names neither tp nor the plan. :func:`install_dry_run` keeps a meta-device
replica of the split model (parameters cost nothing) and, when the model is
first called, runs the same call through the replica before the real one:
no arithmetic, no collective (DTensor's collectives on meta tensors are
shape functions), no random number drawn. A failure that happens in or
after a split layer becomes a :class:`~mmpar.failures.ConfigError` naming
``parallel.tp_plan``, the module, its style and the error, on every rank.

Why the first call, not the build: the batch is not known before it, and
drawing one early (or running the data pipeline on a sample) would move the
data loader's random stream away from one process's.

What this cannot see: a fused projection split plainly whose attention reads
its head count from the local shape (``reshape(B, N, 3, -1, head_dim)``)
runs with every shape right and wrong values; only the plan can say it is
fused (``dict(style='colwise', fused=3)``, docs/tensor_parallel.md).
"""
import copy
import threading
import weakref
from typing import Any, Dict, List, Optional

import torch
from mmengine.logging import print_log
from mmengine.structures import BaseDataElement
from torch import nn
from torch.distributed.tensor import DTensor

from mmpar import device
from mmpar.failures import ConfigError
from mmpar.parallel.dtensor import local_tensor

KEY = 'parallel.tp_plan'
# Models whose first call is still to be dry-run -> the hook's handle.
_PENDING: 'weakref.WeakKeyDictionary[nn.Module, Any]' = \
    weakref.WeakKeyDictionary()


def split_labels(model: nn.Module) -> Dict[str, str]:
    """``{module name: its layout}`` for modules holding DTensor parameters:
    what a plan that is not ``module_plan`` data is described by."""
    labels = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if isinstance(param, DTensor):
                labels[name] = 'placements ' + ', '.join(
                    str(p) for p in param.placements)
                break
    return labels


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        local = torch.empty_like(local_tensor(tensor), device='meta')
        return DTensor.from_local(local, tensor.device_mesh,
                                  tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    return torch.empty_like(tensor, device='meta')


def meta_replica(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of
    the same shapes and layouts (the module tree and its hooks copied, the
    tensors never)."""
    memo: Dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(_meta_like(param),
                                       requires_grad=param.requires_grad)
        if isinstance(param, DTensor):
            memo[id(param.device_mesh)] = param.device_mesh
    for buffer in model.buffers():
        memo[id(buffer)] = _meta_like(buffer)
    return copy.deepcopy(model, memo)


def to_meta(data: Any) -> Any:
    """Tensors (in dicts, lists, tuples and MMEngine data elements) as meta
    tensors of the same shapes."""
    if isinstance(data, torch.Tensor):
        return _meta_like(data)
    if isinstance(data, BaseDataElement):
        return data.to('meta')
    if isinstance(data, dict):
        return {k: to_meta(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(to_meta(v) for v in data)
    return data


def _needs_values(err: Exception) -> bool:
    """The forward needs real values (``.item()``, a copy to the host,
    data-dependent shapes): the meta device cannot say anything."""
    return isinstance(err, NotImplementedError) or \
        'meta' in str(err).lower() or 'data-dependent' in str(err).lower()


def dry_run(replica: nn.Module, labels: Dict[str, str], args: tuple,
            kwargs: dict, key: str = KEY) -> Optional[str]:
    """Run ``replica(*args, **kwargs)`` on meta copies of the arguments.

    Args:
        replica: the split model's :func:`meta_replica`.
        labels: ``{module name: style}`` of the split modules.
        args, kwargs: the model's first call (real or meta tensors).
        key: the config key to name.

    Returns:
        None when the forward ran, or why it could not be checked (a forward
        that needs real values, or that fails before any split layer runs:
        then not the plan's doing, and the real forward reports it).

    Raises:
        ConfigError: the forward fails in a split layer, or in a module after
            a split layer returned, naming ``key``, the module, the style and
            the error.
    """
    in_flight: List[str] = []
    returned: List[str] = []
    handles = []
    for name, module in replica.named_modules():

        def enter(_, __, name=name):
            in_flight.append(name)

        def leave(_, __, ___, name=name):
            in_flight.pop()
            if name in labels:
                returned.append(name)

        handles += [module.register_forward_pre_hook(enter),
                    module.register_forward_hook(leave)]
    try:
        err = _outside_modes(replica, to_meta(args), to_meta(kwargs))
    finally:
        for handle in handles:
            handle.remove()
    if err is not None:
        return _judge(err, replica, labels, in_flight, returned, key)
    return None


def _outside_modes(replica: nn.Module, args: tuple,
                   kwargs: dict) -> Optional[Exception]:
    """Call ``replica`` in a thread of its own and return what it raised.

    Dispatch and function modes are thread-local: a new thread starts
    outside the caller's (a ``CommDebugMode`` or ``FlopCounterMode`` around
    the first step must not count the dry run), with no private torch call.
    The caller waits, so nothing runs beside it. The thread takes the
    caller's accelerator (the current device is per thread too).
    """
    raised: List[Exception] = []
    place = device.current_device()

    def call():
        try:
            if place.index is not None:
                device.set_device(place.index)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                replica(*args, **kwargs)
        except Exception as err:  # noqa: B902 - any error the model hits
            raised.append(err)

    thread = threading.Thread(target=call, name='mmpar-tp-dry-run')
    thread.start()
    thread.join()
    return raised[0] if raised else None


def _judge(err: Exception, replica: nn.Module, labels: Dict[str, str],
           in_flight: List[str], returned: List[str],
           key: str) -> Optional[str]:
    error = f'{type(err).__name__}: {err}'.strip().rstrip('.')
    if _needs_values(err):
        return f'the forward needs real values ({error})'
    failing = in_flight[-1] if in_flight else ''
    last = returned[-1] if returned else None
    after = f'after {last!r} (style {labels[last]}) returned its split ' \
        'output' if last else ''
    if last and last.startswith(f'{failing}.'):
        where = f'in {failing!r} {after}'  # the split child's output
    elif failing in labels:
        where = f'in {failing!r} (style {labels[failing]})'
    elif last:
        where = f'in {failing or type(replica).__name__!r} {after}'
    else:
        return f'the forward fails before any split layer ({error})'
    refusal = ConfigError(
        f'{key}: the split model cannot run: its forward (dry-run on the '
        f'meta device at the first call) fails {where}: {error}. Allowed: a '
        'plan whose split shapes the model accepts. A projection packing '
        "several outputs (rows [q; k; v]) needs dict(style='colwise', "
        'fused=3), and attention must take its head count from the local '
        'shape (reshape with -1 for the heads); or leave the module out of '
        'the plan (docs/tensor_parallel.md)')
    # The module to blame by its plain name, for tools/verify.py.
    refusal.module = failing if failing in labels else (last or failing)
    raise refusal from err


def install_dry_run(model: nn.Module, labels: Dict[str, str],
                    key: str = KEY) -> None:
    """Dry-run ``model``'s first call on a meta replica before the call
    itself (see the module docstring). A model that cannot be copied is
    left unchecked, with a warning."""
    try:
        replica = meta_replica(model)
    except Exception as err:  # noqa: B902 - a model deepcopy refuses
        print_log(f'{key}: the split model is not dry-run before its first '
                  f'forward (it cannot be copied: {err})', logger='current',
                  level=30)
        return

    done = []  # shared by copies of the model (an EMA average) and hooks

    def check(module, args, kwargs):
        cancel_dry_run(model)
        if done:
            return
        done.append(True)
        why = dry_run(replica, labels, args, kwargs, key)
        if why is not None:
            print_log(f'{key}: the split model\'s first forward was not '
                      f'checked on the meta device: {why}', logger='current',
                      level=30)

    _PENDING[model] = model.register_forward_pre_hook(check,
                                                       with_kwargs=True)


def cancel_dry_run(model: nn.Module) -> None:
    """Drop ``model``'s pending dry run: the pipeline calls its stages, cut
    from the model, with a stage's inputs (hidden states after the first),
    which the whole model's replica cannot take."""
    handle = _PENDING.pop(model, None)
    if handle is not None:
        handle.remove()
