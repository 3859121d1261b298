"""A model written for MMEngine with its own ``val_step``/``test_step``
(test-time augmentation, custom inference), under mmpar's wrappers: called
where MMEngine's DDP calls it (the module evaluated whole on each rank), as
at world size 1 where no wrapper is built."""
import pytest
import torch.distributed as dist

from mmpar.registry import MODEL_WRAPPERS
from tests.toy import ToyModel, make_batches, shard_batch


class OwnSteps(ToyModel):
    """Tags what each step returns, so a test can tell which ran."""

    def val_step(self, data):
        return [('val_step', p) for p in super().val_step(data)]

    def test_step(self, data):
        return [('test_step', p) for p in super().test_step(data)]


def _tags(wrapper_cfg):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = MODEL_WRAPPERS.build(wrapper_cfg,
                                   default_args=dict(module=OwnSteps()))
    batch = shard_batch(make_batches(num_batches=1, batch_size=8)[0], rank,
                        world)
    return ({tag for tag, _ in wrapper.val_step(batch)},
            {tag for tag, _ in wrapper.test_step(batch)})


@pytest.mark.parametrize('wrapper', ['MMDistributedDataParallel',
                                     'MMNaiveDataParallel',
                                     'MMBucketDataParallel', 'MMFullyShard'])
def test_the_models_own_val_and_test_steps_run(run_dist, wrapper):
    for val_tags, test_tags in run_dist(_tags, dict(type=wrapper)):
        assert (val_tags, test_tags) == ({'val_step'}, {'test_step'})
