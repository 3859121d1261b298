"""MMEngine's ``CheckpointHook`` with asynchronous saves (``async_save``).

``default_hooks.checkpoint = dict(type='CheckpointHook', async_save=True)``
builds this hook (the Runner swaps the class, on a copy of the config): the
train loop blocks only while the state is staged, and ``last_checkpoint``
moves once the background write has renamed the checkpoint into place, never
before (docs/fault_tolerance.md). The Runner builds it for MMEngine's
``CheckpointHook`` without ``async_save`` too: there it saves as MMEngine's
does, except that ``max_keep_ckpts`` removes the oldest checkpoint only once
the new one is complete and ``last_checkpoint`` names it (MMEngine removes it
before the save, so a kill during the save left none).
"""
import os
import os.path as osp

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook as MMEngineCheckpointHook

from mmpar.checkpoint.format import (MMENGINE_CHECKPOINT_HOOK,
                                     check_async_save)
from mmpar.failures import ConfigError
from mmpar.registry import HOOKS

# The ``type`` values of MMEngine's hook, with or without a scope.
_MMENGINE_NAMES = ('CheckpointHook', 'mmengine.CheckpointHook')


def write_pointer(work_dir: str, checkpoint: str) -> None:
    """``work_dir/last_checkpoint`` naming ``checkpoint``, replaced
    atomically (a reader sees the old name or the new one)."""
    pointer = osp.join(work_dir, 'last_checkpoint')
    tmp = f'{pointer}.{os.getpid()}.tmp'
    with open(tmp, 'w') as file:
        file.write(checkpoint)
    os.replace(tmp, pointer)


@HOOKS.register_module()
class AsyncCheckpointHook(MMEngineCheckpointHook):
    """``CheckpointHook`` whose saves write in the background, and whose
    ``max_keep_ckpts`` removes a checkpoint only once the next one is
    published.

    Args:
        async_save: stage the state and write it in the background (the
            default here; ``False`` saves synchronously, as MMEngine's hook).
        **kwargs: MMEngine's ``CheckpointHook`` arguments.
    """

    def __init__(self, async_save: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.async_save = check_async_save(async_save)

    def _save_checkpoint_with_step(self, runner, step, meta):
        if self.async_save:
            # At most one save in flight: the previous one is complete (or
            # its failure raised) before a new one starts.
            runner.checkpoint_writes.wait()
        # MMEngine's bookkeeping of keep_ckpt_ids, but the checkpoint that
        # leaves it is removed only after the new one is published: a kill
        # during the save keeps it, and last_checkpoint still names it.
        outdated = None
        if self.max_keep_ckpts > 0 and not (
                self.keep_ckpt_ids and self.keep_ckpt_ids[-1] == step):
            if len(self.keep_ckpt_ids) == self.max_keep_ckpts:
                outdated = self.keep_ckpt_ids.popleft()
            self.keep_ckpt_ids.append(step)
            runner.message_hub.update_info('keep_ckpt_ids',
                                           list(self.keep_ckpt_ids))
        filename = self.filename_tmpl.format(step)
        self.last_ckpt = self.file_backend.join_path(self.out_dir, filename)
        runner.message_hub.update_info('last_ckpt', self.last_ckpt)
        args = dict(self.args, async_save=True) if self.async_save else \
            self.args
        runner.save_checkpoint(
            self.out_dir,
            filename,
            self.file_client_args,
            save_optimizer=self.save_optimizer,
            save_param_scheduler=self.save_param_scheduler,
            meta=meta,
            by_epoch=self.by_epoch,
            backend_args=self.backend_args,
            **args)
        if not is_main_process():
            return
        last, work_dir = self.last_ckpt, runner.work_dir

        def publish():
            write_pointer(work_dir, last)
            if outdated is not None:
                self._remove(outdated)

        if self.async_save:
            # In the writer thread, after the rename; never after a failure.
            runner.checkpoint_writes.then(publish)
        else:
            publish()

    def _remove(self, step) -> None:
        if not is_main_process():
            return
        path = self.file_backend.join_path(self.out_dir,
                                           self.filename_tmpl.format(step))
        if self.file_backend.isfile(path):
            self.file_backend.remove(path)
        elif self.file_backend.isdir(path):  # a sharded checkpoint
            self.file_backend.rmtree(path)

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        # A failed background write is raised at the next step, not lost.
        runner.checkpoint_writes.check()
        super().after_train_iter(runner, batch_idx, data_batch, outputs)

    def after_train(self, runner) -> None:
        # The last save is complete (and published) before training ends.
        runner.checkpoint_writes.wait()
        super().after_train(runner)

    def after_run(self, runner) -> None:
        runner.checkpoint_writes.close()


def with_async_hook(default_hooks):
    """``default_hooks`` with :class:`AsyncCheckpointHook` as the checkpoint
    hook where it is MMEngine's ``CheckpointHook`` (named, or MMEngine's
    default when ``checkpoint`` is absent), with or without ``async_save``;
    the user's dict unchanged.

    Raises:
        ConfigError: ``async_save`` on a checkpoint hook of another type.
    """
    hooks = dict(default_hooks or {})
    # MMEngine's default when the key is absent (None turns it off).
    ckpt = hooks.get('checkpoint', MMENGINE_CHECKPOINT_HOOK)
    if not isinstance(ckpt, dict):
        return default_hooks
    kind = ckpt.get('type', 'CheckpointHook')
    if kind in (AsyncCheckpointHook, 'AsyncCheckpointHook'):
        return default_hooks
    if kind not in _MMENGINE_NAMES + (MMEngineCheckpointHook, ):
        if ckpt.get('async_save'):
            raise ConfigError(
                f'default_hooks.checkpoint.type={kind!r} with '
                'async_save=True: only MMEngine\'s CheckpointHook writes in '
                "the background; allowed: type='CheckpointHook' or "
                'async_save=False')
        return default_hooks
    # MMEngine's hook saves synchronously unless the config asks otherwise
    # (this class's own default, for a config naming it, is async).
    hooks['checkpoint'] = dict(ckpt, type=AsyncCheckpointHook,
                               async_save=ckpt.get('async_save', False))
    return hooks
