from mmpar.optim.amp import AmpOptimWrapper

__all__ = ['AmpOptimWrapper']
