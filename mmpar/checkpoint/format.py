"""The ``checkpoint_format`` config value and what it changes in the hooks."""
import copy
from typing import Any, Optional

# Top-level ``checkpoint_format`` (docs/checkpoints.md).
FORMATS = ('full', 'sharded')


def check_checkpoint_format(value: Any) -> str:
    """The validated ``checkpoint_format`` config value.

    Raises:
        ValueError: not one of :data:`FORMATS`.
    """
    if value not in FORMATS:
        raise ValueError(f'checkpoint_format={value!r} is not a checkpoint '
                         f'format; allowed: {", ".join(map(repr, FORMATS))}')
    return value


def check_async_save(value: Any) -> bool:
    """``default_hooks.checkpoint.async_save``, validated.

    Raises:
        ValueError: not a bool.
    """
    if not isinstance(value, bool):
        raise ValueError(
            f'default_hooks.checkpoint.async_save={value!r} is not allowed; '
            'allowed: True (write checkpoints in the background) or False')
    return value


def checkpoint_format(cfg) -> str:
    """``cfg.checkpoint_format`` (default ``'full'``), validated."""
    return check_checkpoint_format((cfg or {}).get('checkpoint_format',
                                                   'full'))


def check_published_keys(cfg) -> None:
    """``default_hooks.checkpoint.published_keys`` needs full checkpoints:
    MMEngine's CheckpointHook publishes after training by loading the last
    (and best) checkpoint as one file, and a sharded one is a directory
    (the finished run would exit 1 with a FileNotFoundError).

    Raises:
        ValueError: naming the key, the value and what is allowed.
    """
    hook = ((cfg or {}).get('default_hooks') or {}).get('checkpoint')
    keys = hook.get('published_keys') if isinstance(hook, dict) else None
    if keys is not None and checkpoint_format(cfg) == 'sharded':
        raise ValueError(
            f'default_hooks.checkpoint.published_keys={keys!r} is not '
            "allowed with checkpoint_format='sharded': publishing loads the "
            'checkpoint as one file, and a sharded one is a directory; '
            "allowed: checkpoint_format='full', or no published_keys and "
            'tools/convert_checkpoint.py to turn a sharded checkpoint into '
            'one full file')


# MMEngine's Runner's checkpoint hook when ``default_hooks`` names none.
MMENGINE_CHECKPOINT_HOOK = dict(type='CheckpointHook', interval=1)


def sharded_hook_names(default_hooks: Optional[dict]) -> Optional[dict]:
    """``default_hooks`` with CheckpointHook naming directories without
    ``.pth`` (``epoch_{}`` / ``iter_{}``) unless the user chose a template.

    Returns a copy; the user's config is not changed.
    """
    hooks = copy.deepcopy(default_hooks) if default_hooks else default_hooks
    ckpt = (hooks or {}).get('checkpoint')
    if isinstance(ckpt, dict) and ckpt.get('filename_tmpl') is None:
        by_epoch = ckpt.get('by_epoch', True)
        ckpt['filename_tmpl'] = 'epoch_{}' if by_epoch else 'iter_{}'
    return hooks
