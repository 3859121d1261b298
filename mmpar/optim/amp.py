"""An ``AmpOptimWrapper`` that also runs on CPU.

MMEngine 0.10.7's ``AmpOptimWrapper`` refuses to start without an accelerator,
although its ``autocast`` does bf16 on CPU. bf16 keeps fp32's exponent range,
so CPU training needs no loss scaling: this wrapper uses a disabled
``GradScaler`` there and inherits everything else unchanged.
"""
import torch
from mmengine.optim import AmpOptimWrapper as MMEngineAmpOptimWrapper
from mmengine.optim import OptimWrapper

from mmpar.registry import OPTIM_WRAPPERS

CPU_DTYPES = ('bfloat16', )


@OPTIM_WRAPPERS.register_module()
class AmpOptimWrapper(MMEngineAmpOptimWrapper):
    """MMEngine's AMP optim wrapper, plus bf16 autocast on CPU.

    Registered under the same name in the ``mmpar`` scope, so
    ``optim_wrapper = dict(type='AmpOptimWrapper', ...)`` works on any device.

    Args:
        loss_scale: as MMEngine's (used on accelerators only).
        dtype: autocast dtype; on CPU only ``'bfloat16'`` (the default there).
        use_fsdp: use ``ShardedGradScaler`` (accelerators only).
        **kwargs: passed to ``OptimWrapper``.

    Raises:
        ValueError: a CPU ``dtype`` other than bfloat16.
    """

    def __init__(self, loss_scale='dynamic', dtype=None, use_fsdp=False,
                 **kwargs):
        if torch.cuda.is_available():
            super().__init__(loss_scale, dtype, use_fsdp, **kwargs)
            return
        dtype = dtype or 'bfloat16'
        name = str(dtype).replace('torch.', '')
        if name not in CPU_DTYPES:
            raise ValueError(f'optim_wrapper.dtype={dtype!r} is not supported '
                             f'for AMP on CPU; allowed: {", ".join(CPU_DTYPES)}')
        OptimWrapper.__init__(self, **kwargs)
        self._scale_update_param = None
        self.loss_scaler = torch.amp.GradScaler('cpu', enabled=False)
        self.cast_dtype = torch.bfloat16
