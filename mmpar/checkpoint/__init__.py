"""Checkpoints: full (one file) and sharded (DCP directory) formats.

Functions of (model, optim wrapper, extras), not of the Runner:

- :mod:`~mmpar.checkpoint.files`: plain data on disk, atomic saves, loads
  with clear errors;
- :mod:`~mmpar.checkpoint.state`: model and optimizer state under any
  layout, in the plain model's terms (:mod:`~mmpar.checkpoint.pipeline`
  for a pipelined model's stages);
- :mod:`~mmpar.checkpoint.full` and :mod:`~mmpar.checkpoint.sharded`: the
  two formats; :mod:`~mmpar.checkpoint.format`: the config value;
- :mod:`~mmpar.checkpoint.latest`: which checkpoint to resume from;
- :mod:`~mmpar.checkpoint.rng`: every rank's generator states;
- :mod:`~mmpar.checkpoint.shadow`: a second set of the model's values (an
  averaged copy) saved and loaded through the model;
  :mod:`~mmpar.checkpoint.refs`: the stand-ins hooks see for the tensors of
  a sharded checkpoint;
- Hugging Face weights in and out: :mod:`mmpar.models.hf_weights` (its
  readers are re-exported here).

The Runner's glue (what it adds, the plain-data hook) is
``mmpar/runner/checkpoint.py``.
"""
from mmpar.checkpoint.files import (CheckpointLoadError, atomic_save,
                                    from_plain, load_checkpoint_file,
                                    to_cpu, to_plain)
from mmpar.checkpoint.full import collect_checkpoint
from mmpar.models.hf_weights import is_hf_checkpoint, read_hf_state_dict
from mmpar.checkpoint.latest import (complete_checkpoints,
                                     find_latest_complete_checkpoint,
                                     is_complete_checkpoint)
from mmpar.checkpoint.rng import (all_rng_states, restore_rng_states,
                                  rng_state, set_rng_state)
from mmpar.checkpoint.sharded import (is_sharded_checkpoint, load_sharded,
                                      save_sharded, sharded_to_full)
from mmpar.checkpoint.state import (load_model_state,
                                    localize_optim_state, model_state,
                                    optimizer_state)

__all__ = [
    'CheckpointLoadError', 'all_rng_states', 'atomic_save',
    'collect_checkpoint', 'complete_checkpoints',
    'find_latest_complete_checkpoint', 'from_plain',
    'is_complete_checkpoint', 'is_hf_checkpoint', 'is_sharded_checkpoint',
    'load_checkpoint_file', 'load_model_state', 'load_sharded',
    'localize_optim_state', 'model_state', 'optimizer_state',
    'read_hf_state_dict', 'restore_rng_states', 'rng_state', 'save_sharded',
    'set_rng_state', 'sharded_to_full', 'to_cpu', 'to_plain'
]
