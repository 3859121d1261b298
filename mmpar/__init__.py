"""mmpar: choose how a PyTorch model trains in parallel from a config file."""
from mmpar.version import __version__

__all__ = ['__version__', 'Runner']


def __getattr__(name):
    # ``mmpar.Runner`` imports mmengine.runner (~1 s); load it on first use.
    if name == 'Runner':
        from mmpar.runner import Runner
        return Runner
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
