"""parallel.ep is refused at start-up where it cannot train, naming the
key (no process group needed)."""
import pytest

from mmpar.config_check import check_layout
from mmpar.failures import ConfigError

FSDP2 = dict(type='MMFullyShard')
MOE = dict(type='Llama', moe=dict(num_experts=4))


def _check(world=2, model=MOE, wrapper=FSDP2, **parallel):
    return check_layout(dict(model=model, model_wrapper_cfg=wrapper,
                             parallel=dict(ep=2, **parallel)), world)


def test_ep_inside_the_data_ranks():
    dims = _check(world=4).dims
    assert (dims.ep, dims.dp_shard, dims.dp, dims.dp_cp, dims.efsdp) == (
        2, 2, 4, 4, 2)


@pytest.mark.parametrize('kwargs,message', [
    (dict(model=dict(type='Llama')), "parallel.ep=2 is not allowed; "
     "model.type='Llama' has no mixture-of-experts layers"),
    (dict(model=None), 'parallel.ep=2 is not allowed; model.type=None has '
     'no mixture-of-experts layers'),
    (dict(model=dict(type='Llama', moe=dict(num_experts=3))),
     'model.moe.num_experts=3 is not allowed; parallel.ep=2 splits'),
    (dict(wrapper=None), "model_wrapper_cfg.type='MMDistributedDataParallel'"
     ' cannot wrap an expert-parallel model'),
    (dict(world=4, cp=2), 'parallel.cp=2 with parallel.ep=2 is not '
     'supported yet'),
    (dict(world=4, dp_replicate=2), 'parallel.dp_replicate=2 with '
     'parallel.ep=2 is not supported yet'),
    (dict(world=3), 'world size 3 is not divisible by'),
])
def test_refused_naming_the_key(kwargs, message):
    with pytest.raises((ConfigError, ValueError)) as err:
        _check(**kwargs)
    assert message in str(err.value)
