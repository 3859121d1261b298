"""Activation checkpointing: step 3 of compose's order, for every layout.

Config (top level)::

    activation_checkpointing = dict(
        module_classes=['LlamaBlock'],  # which modules to checkpoint
        every=1,                        # every k-th of them (1: all)
        mode='full')                    # or 'selective'

``mode='full'`` keeps only each checkpointed module's inputs and recomputes
its whole forward in backward. ``mode='selective'`` (torchtitan's per-op
selective checkpointing) keeps the outputs of the expensive ops inside the
module (matrix multiplications and attention, :data:`SAVE_OPS`; more by
name with ``save_ops=['aten.max.default', ...]``) and recomputes the cheap
rest (norms, activations, element-wise ops): less memory than none, less
recomputation than full.

or just the class names (``activation_checkpointing = 'LlamaBlock'`` or a
list). The older spelling inside an FSDP wrapper's config,
``model_wrapper_cfg.activation_checkpointing=[...]``, means the same and is
still accepted (compose takes it out of the wrapper's arguments).

A checkpointed module is the same module (its class gets
:class:`Checkpointed` in front, whose forward runs the module's own through
``torch.utils.checkpoint.checkpoint``, non-reentrant): its parameter and
state-dict names and its type are unchanged, so checkpoints,
tensor-parallel plans and wrap policies see the same model. Applied after tensor parallelism and the
pipeline split, before ``torch.compile`` and the data-parallel wrapper, as
torchtitan orders it: the data-parallel hooks then run outside the
recomputation.
"""
import functools
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts,
                                    noop_context_fn)

from mmpar.checks import check_int
from mmpar.wrappers.policies import resolve_module_classes

KEY = 'activation_checkpointing'
OWN_KEYS = ('module_classes', 'every', 'mode', 'save_ops')
MODES = ('full', 'selective')
# Ops whose outputs selective checkpointing keeps (the rest is recomputed).
SAVE_OPS = ('aten.mm.default', 'aten.addmm.default', 'aten.bmm.default',
            'aten.baddbmm.default',
            'aten._scaled_dot_product_flash_attention.default',
            'aten._scaled_dot_product_efficient_attention.default',
            'aten._scaled_dot_product_cudnn_attention.default',
            'aten._scaled_dot_product_flash_attention_for_cpu.default')


def check_activation_checkpointing(cfg: Any, key: str = KEY) -> Optional[dict]:
    """``cfg`` normalised to ``dict(module_classes=[...], every=k)``, or None.

    Raises:
        TypeError / ValueError: a value of the wrong type, an unknown key or
            a bad ``every``, naming the key.
    """
    if cfg is None or cfg is False:
        return None
    if isinstance(cfg, (str, type)) or (
            isinstance(cfg, (list, tuple)) and cfg and
            all(isinstance(c, (str, type)) for c in cfg)):
        cfg = dict(module_classes=cfg)
    if not isinstance(cfg, dict):
        raise TypeError(f'{key}={cfg!r} must be None, module class names '
                        '(or classes, a list of them) or dict(module_classes='
                        '[...], every=1)')
    unknown = sorted(set(cfg) - set(OWN_KEYS))
    if unknown:
        raise ValueError(f'{key}: unknown key(s) {unknown}; allowed: '
                         f'{", ".join(OWN_KEYS)}')
    classes = cfg.get('module_classes')
    if isinstance(classes, (str, type)):
        classes = [classes]
    if not classes or not all(isinstance(c, (str, type)) for c in classes):
        raise TypeError(f'{key}.module_classes={classes!r} must be module '
                        'class names or classes (a list of them)')
    every = check_int(f'{key}.every', cfg.get('every', 1))
    mode = cfg.get('mode', 'full')
    if mode not in MODES:
        raise ValueError(f'{key}.mode={mode!r} is not allowed; allowed: '
                         f'{", ".join(MODES)}')
    save_ops = cfg.get('save_ops') or []
    if mode != 'selective' and save_ops:
        raise ValueError(f'{key}.save_ops={save_ops!r} needs '
                         "mode='selective'")
    ops = [_op(name, f'{key}.save_ops') for name in save_ops]
    return dict(module_classes=list(classes), every=every, mode=mode,
                save_ops=[str(op) for op in ops])


def _op(name: str, key: str):
    """``'aten.mm.default'`` -> the op; raises ValueError naming it."""
    if not isinstance(name, str):
        raise ValueError(f'{key}: {name!r} is not an op name such as '
                         "'aten.mm.default'")
    namespace, _, rest = name.partition('.')
    packet, _, overload = rest.partition('.')
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet),
                       overload or 'default')
    except (AttributeError, RuntimeError):
        raise ValueError(f'{key}: {name!r} is not an op; allowed: names such '
                         "as 'aten.mm.default'") from None


def _selective_context(save_ops: list):
    """A ``context_fn`` for torch's checkpoint that keeps the outputs of
    :data:`SAVE_OPS` (and ``save_ops``) and recomputes everything else."""
    keep = set()
    for name in SAVE_OPS + tuple(save_ops):
        try:
            keep.add(_op(name, KEY))
        except ValueError:
            pass  # an attention kernel this build of torch does not have

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in keep \
            else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def merge_wrapper_key(cfg: Any, model_wrapper_cfg: Optional[dict]):
    """``(activation checkpointing cfg, wrapper cfg without it)``: the older
    ``model_wrapper_cfg.activation_checkpointing`` taken out of the wrapper's
    arguments.

    Raises:
        ValueError: both spellings given.
    """
    if not model_wrapper_cfg or KEY not in model_wrapper_cfg:
        return cfg, model_wrapper_cfg
    wrapper_cfg = dict(model_wrapper_cfg)
    legacy = wrapper_cfg.pop(KEY)
    if cfg is not None and legacy is not None:
        raise ValueError(
            f'{KEY}={cfg!r} and model_wrapper_cfg.{KEY}={legacy!r} are both '
            'set; allowed: one of them (the top-level key works for every '
            'wrapper)')
    return (legacy if cfg is None else cfg), wrapper_cfg


class Checkpointed:
    """What a checkpointed module's class adds: its forward runs through
    ``torch.utils.checkpoint.checkpoint`` (non-reentrant; the selective
    mode's ``context_fn`` kept on the module). Mixed in front of the
    module's own class (as FSDP2's ``fully_shard`` does), so the module keeps
    its names, its type for ``isinstance`` and every hook on it."""

    def forward(self, *args, **kwargs):
        context_fn = self.__dict__.get('_ac_context_fn') or noop_context_fn
        return checkpoint(super().forward, *args, use_reentrant=False,
                          context_fn=context_fn, **kwargs)


def _checkpointed_class(cls: type) -> type:
    """``cls`` with :class:`Checkpointed` in front, one class per ``cls``:
    named as ``cls`` (what name-based config keys match), held in this
    module under a unique qualified name (so a model holding it pickles),
    ``cls`` itself kept as ``mmpar_plain_class`` (what class lookups by
    name resolve to, :func:`mmpar.wrappers.policies.model_classes`)."""
    qualname = f'Checkpointed_{cls.__module__}_{cls.__qualname__}'
    qualname = ''.join(c if c.isalnum() else '_' for c in qualname)
    made = globals().get(qualname)
    if made is None:
        made = type(cls.__name__, (Checkpointed, cls),
                    dict(__module__=__name__, __qualname__=qualname,
                         mmpar_plain_class=cls))
        globals()[qualname] = made
    return made


def apply_activation_checkpointing(model: nn.Module, cfg: Any) -> nn.Module:
    """Checkpoint every ``every``-th instance of ``module_classes`` in place.

    Non-reentrant checkpointing: it composes with FSDP's and DTensor's hooks
    and keeps the state-dict keys unchanged.

    Returns:
        ``model``.

    Raises:
        ValueError: class names that match no module of ``model``.
    """
    cfg = check_activation_checkpointing(cfg)
    if cfg is None:
        return model
    classes = resolve_module_classes(model, cfg['module_classes'], key=KEY)
    seen = []

    def chosen(module: nn.Module) -> bool:
        if not isinstance(module, classes):
            return False
        seen.append(module)
        return (len(seen) - 1) % cfg['every'] == 0

    context_fn = (_selective_context(cfg['save_ops'])
                  if cfg['mode'] == 'selective' else None)
    for module in [m for m in model.modules()
                   if not isinstance(m, Checkpointed) and chosen(m)]:
        module.__class__ = _checkpointed_class(type(module))
        module.__dict__['_ac_context_fn'] = context_fn
    return model
