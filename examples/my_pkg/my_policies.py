"""An example user FSDP wrap policy, registered by name for configs.

A config makes it available with::

    custom_imports = dict(
        imports=['examples.my_pkg.my_policies'], allow_failed_imports=False)
    model_wrapper_cfg = dict(
        type='MMFullyShardedDataParallel',
        fsdp_auto_wrap_policy=dict(type='large_linear', min_weight_numel=64))
"""
from torch import nn

from mmpar.registry import FSDP_WRAP_POLICIES


@FSDP_WRAP_POLICIES.register_module()
def large_linear(module: nn.Module,
                 recurse: bool,
                 nonwrapped_numel: int,
                 min_weight_numel: int = 0,
                 **kwargs) -> bool:
    """Give every ``nn.Linear`` with at least ``min_weight_numel`` weights
    its own FSDP unit (smaller layers stay in their parent's unit).

    Torch's policy signature: with ``recurse=True`` answer "look inside?",
    with ``recurse=False`` "wrap this module?". It does not look inside
    ``nn.MultiheadAttention``: that module reads ``out_proj.weight`` directly
    instead of calling ``out_proj``, so an FSDP unit there would never gather
    its parameters.
    """
    if recurse:
        return not isinstance(module, nn.MultiheadAttention)
    return (isinstance(module, nn.Linear)
            and module.weight.numel() >= min_weight_numel)
