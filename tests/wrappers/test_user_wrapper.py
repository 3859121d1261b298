"""A wrapper of the user's own on mmpar's base (docs/architecture.md: a new
wrapper mixes in ``StepMixin``) gets the base's defaults."""
from torch import nn

from mmpar.wrappers.base import StepMixin


class UsersWrapper(StepMixin, nn.Module):

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_evaluation_runs_through_the_wrapper_by_default():
    # An FSDP-like wrapper gathers its parameters in its own forward: the
    # default keeps val_step/test_step going through it. mmpar's DDP and
    # Python data-parallel wrappers say otherwise for themselves.
    wrapper = UsersWrapper(nn.Linear(2, 2))
    assert wrapper.eval_forward_module is wrapper
