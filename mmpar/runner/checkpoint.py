"""The Runner's side of checkpoints: what it adds, and plain data on disk.

The formats themselves live in :mod:`mmpar.checkpoint` as functions of
(model, optim wrapper, extras); this module reads the Runner's own state
into the extras and registers the hook that keeps checkpoints plain data
(loadable with ``torch.load(weights_only=True)``).
"""
from typing import Optional

from mmengine.hooks import Hook

from mmpar.checkpoint import all_rng_states, from_plain, to_cpu, to_plain
from mmpar.registry import HOOKS
from mmpar.runner.data_position import META_KEY as POSITION_KEY
from mmpar.runner.data_position import saved_position


@HOOKS.register_module()
class PlainCheckpointHook(Hook):
    """Keeps checkpoints plain data; the Runner registers it itself."""

    priority = 'VERY_LOW'

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint.update(to_plain(dict(checkpoint)))

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        if 'message_hub' in checkpoint:
            checkpoint['message_hub'] = from_plain(checkpoint['message_hub'])
        # Restored by Runner.resume once MMEngine's resume has finished (it
        # may reseed); a plain load_from leaves the generators alone. So is
        # the data position (in the meta).
        runner._loaded_rng_states = checkpoint.get('rng_states')
        runner._loaded_meta = checkpoint.get('meta') or {}


def checkpoint_extras(runner,
                      meta: Optional[dict] = None,
                      by_epoch: bool = True,
                      save_param_scheduler: bool = True) -> dict:
    """The checkpoint without model and optimizer state: ``meta`` (with the
    data position, :mod:`mmpar.runner.data_position`), ``message_hub``, ``param_schedulers`` and every rank's RNG states, read
    from the Runner (both formats share it; a collective: every rank calls
    it)."""
    import time

    import mmengine

    meta = dict(meta or {})
    if by_epoch:
        # Saved after the epoch's hooks, before `epoch` is incremented.
        meta.setdefault('epoch', runner.epoch + 1)
        meta.setdefault('iter', runner.iter)
    else:
        meta.setdefault('epoch', runner.epoch)
        meta.setdefault('iter', runner.iter + 1)
    meta.setdefault(POSITION_KEY, saved_position(runner, by_epoch))
    meta.update(
        cfg=runner.cfg.pretty_text,
        seed=runner.seed,
        experiment_name=runner.experiment_name,
        time=time.strftime('%Y%m%d_%H%M%S', time.localtime()),
        mmengine_version=mmengine.__version__)
    dataset = runner.train_dataloader.dataset
    if hasattr(dataset, 'metainfo'):
        meta.update(dataset_meta=dataset.metainfo)

    checkpoint = dict(
        meta=meta,
        message_hub=to_cpu(runner.message_hub.state_dict()),
        rng_states=all_rng_states())
    schedulers = runner.param_schedulers
    if save_param_scheduler and schedulers is not None:
        if isinstance(schedulers, dict):
            checkpoint['param_schedulers'] = {
                name: [s.state_dict() for s in group]
                for name, group in schedulers.items()
            }
        else:
            checkpoint['param_schedulers'] = [s.state_dict() for s in schedulers]
    return checkpoint
