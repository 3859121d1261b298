"""Old import path: see :mod:`mmpar.checkpoint.state` and
:mod:`mmpar.parallelize.compose`."""
from mmpar.checkpoint.state import (load_full_model_state,  # noqa
                                    localize_optim_state)
from mmpar.parallelize.compose import is_sharded, wrapper_shards  # noqa
