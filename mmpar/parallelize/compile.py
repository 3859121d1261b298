"""``torch.compile`` from config, one transformer block at a time.

Config key ``model_compile`` (not MMEngine's ``compile``, which compiles the
whole wrapped ``train_step`` and passes every key to ``torch.compile``)::

    model_compile = dict(
        per_block=True,         # compile each block; False: the whole model
        module_classes=None,    # block classes; None: children of `layers`
                                # / `blocks` containers
        backend='inductor', mode=None, fullgraph=False, dynamic=None,
        options=None)           # passed to torch.compile

Why per block: every block runs the same code, so one compiled graph serves
them all (compile time does not grow with depth), and a block is the unit
FSDP shards and activation checkpointing wraps, so graphs never cross their
boundaries (torchtitan's ``apply_compile``). Only each block's ``forward`` is
compiled, in place: module names, classes and ``state_dict`` keys do not
change (no ``_orig_mod.``), so wrap policies, tensor-parallel plans and
checkpoints see the same model, and the hooks FSDP registers on the block run
outside the compiled code. Applied after tensor parallelism and activation
checkpointing, before the data-parallel wrapper.
"""
from typing import Any, List, Optional

import torch
from torch import nn

TORCH_KEYS = ('backend', 'mode', 'fullgraph', 'dynamic', 'options')
OWN_KEYS = ('per_block', 'module_classes')
CONTAINER_NAMES = ('layers', 'blocks')


def check_compile_cfg(cfg: Any, key: str = 'model_compile') -> Optional[dict]:
    """``cfg`` normalised: ``None``/``False`` -> ``None``, ``True`` -> the
    defaults, a dict checked key by key.

    Raises:
        ValueError: an unknown key or a value of the wrong type, naming it.
    """
    if cfg is None or cfg is False:
        return None
    if cfg is True:
        cfg = {}
    if not isinstance(cfg, dict):
        raise ValueError(f'{key}={cfg!r} must be a dict, True, False or None')
    unknown = sorted(set(cfg) - set(TORCH_KEYS) - set(OWN_KEYS))
    if unknown:
        raise ValueError(f'{key}: unknown key(s) {unknown}; allowed: '
                         f'{", ".join(OWN_KEYS + TORCH_KEYS)}')
    cfg = dict(cfg)
    if not isinstance(cfg.setdefault('per_block', True), bool):
        raise ValueError(f'{key}.per_block={cfg["per_block"]!r} must be '
                         'True or False')
    classes = cfg.get('module_classes')
    if classes is not None and (not isinstance(classes, (list, tuple)) or
                                not all(isinstance(c, str) for c in classes)):
        raise ValueError(f'{key}.module_classes={classes!r} must be a list '
                         'of class names or None')
    backend = cfg.get('backend', 'inductor')
    if isinstance(backend, str) and backend not in \
            torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(
            f'{key}.backend={backend!r} is not a torch.compile backend; '
            f'allowed: {", ".join(torch.compiler.list_backends())}')
    torch_args = {k: cfg[k] for k in TORCH_KEYS if k in cfg}
    try:
        # torch.compile checks its arguments (mode, mode with options) when
        # called, compiling nothing until the result runs.
        torch.compile(_nothing, **torch_args)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(f'{key}: torch.compile refuses {torch_args}: '
                         f'{err}') from None
    return cfg


def _nothing() -> None:
    """What the argument check compiles (never run)."""


def find_blocks(model: nn.Module,
                module_classes: Optional[List[str]] = None) -> List[nn.Module]:
    """The blocks to compile: the outermost modules of ``module_classes``, or
    else the children of every ``nn.ModuleList``/``nn.ModuleDict`` named
    ``layers`` or ``blocks``.

    Raises:
        ValueError: nothing matched (lists what to set).
    """
    blocks = []
    if module_classes:
        for name, module in model.named_modules():
            inside = any(name.startswith(f'{outer}.') for outer, _ in blocks)
            if type(module).__name__ in module_classes and not inside:
                blocks.append((name, module))
    else:
        for name, module in model.named_modules():
            if name.rsplit('.', 1)[-1] in CONTAINER_NAMES and isinstance(
                    module, (nn.ModuleList, nn.ModuleDict)):
                blocks += [(f'{name}.{child}', block)
                           for child, block in module.named_children()]
    if not blocks:
        raise ValueError(
            'model_compile.per_block=True found no blocks: the model has no '
            f'ModuleList/ModuleDict named {" or ".join(CONTAINER_NAMES)}'
            + (f' and no module of class {module_classes}'
               if module_classes else '')
            + '; allowed: set model_compile.module_classes=[...] to the '
            'block class names, or per_block=False')
    return [module for _, module in blocks]


def apply_compile(model: nn.Module, cfg: Any) -> nn.Module:
    """Compile ``model``'s blocks (or the whole model) in place.

    Args:
        model: the plain (or tensor-parallel) model, not yet wrapped for
            data parallelism.
        cfg: the ``model_compile`` config (see the module docstring).

    Returns:
        ``model`` itself.
    """
    cfg = check_compile_cfg(cfg)
    if cfg is None:
        return model
    kwargs = {k: cfg[k] for k in TORCH_KEYS if k in cfg}
    targets = find_blocks(model, cfg.get('module_classes')) \
        if cfg['per_block'] else [model]
    for module in targets:
        # The bound forward, not the module: hooks stay eager and names stay.
        module.forward = torch.compile(module.forward, **kwargs)
    return model
