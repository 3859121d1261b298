"""Old import path of the sharded format: see :mod:`mmpar.checkpoint.sharded`
and :mod:`mmpar.checkpoint.format`."""
from mmpar.checkpoint.format import (FORMATS, check_checkpoint_format,  # noqa
                                     checkpoint_format, sharded_hook_names)
from mmpar.checkpoint.sharded import (DCP_METADATA, PLAIN_FILE,  # noqa
                                      is_complete_sharded_checkpoint,
                                      is_sharded_checkpoint, load_plain_state,
                                      load_sharded, merge, save_sharded,
                                      sharded_to_full, split_tensors)
from mmpar.checkpoint.state import stateful_module as _stateful_module  # noqa
