"""A downstream project's optim wrapper, registered in MMEngine's registry
(as OpenMMLab projects register theirs), loaded through ``custom_imports``:
mmpar's wrappers adopt it, and its own ``step`` runs."""
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

STEP_MARKER = 'DownstreamOptimWrapper.step'
AMP_STEP_MARKER = 'DownstreamAmpOptimWrapper.step'


@OPTIM_WRAPPERS.register_module(force=True)
class DownstreamOptimWrapper(OptimWrapper):
    """Counts its steps and prints each one (the launch tests read it)."""

    num_steps = 0

    def step(self, **kwargs):
        self.num_steps += 1
        print(f'{STEP_MARKER} {self.num_steps} after {self.inner_count} '
              'backward passes', flush=True)
        super().step(**kwargs)


@OPTIM_WRAPPERS.register_module(force=True)
class DownstreamAmpOptimWrapper(AmpOptimWrapper):
    """The same for MMEngine's AMP wrapper (accelerators only: MMEngine's
    refuses to start on a CPU)."""

    num_steps = 0

    def step(self, **kwargs):
        self.num_steps += 1
        print(f'{AMP_STEP_MARKER} {self.num_steps}', flush=True)
        super().step(**kwargs)
