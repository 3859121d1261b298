"""A downstream project's optim wrapper, registered in MMEngine's registry
(as OpenMMLab projects register theirs), loaded through ``custom_imports``:
mmpar's wrappers adopt it, and its own ``step`` runs."""
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

STEP_MARKER = 'DownstreamOptimWrapper.step'


@OPTIM_WRAPPERS.register_module(force=True)
class DownstreamOptimWrapper(OptimWrapper):
    """Counts its steps and prints each one (the launch tests read it)."""

    num_steps = 0

    def step(self, **kwargs):
        self.num_steps += 1
        print(f'{STEP_MARKER} {self.num_steps} after {self.inner_count} '
              'backward passes', flush=True)
        super().step(**kwargs)
