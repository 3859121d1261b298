"""parallel.ep is refused at start-up where it cannot train, naming the
key, and a model's experts modules are checked against the expert-parallel
protocol when it is built, naming the module (no process group needed)."""
import pytest
import torch

from mmpar.config_check import check_layout
from mmpar.failures import ConfigError
from mmpar.parallelize.expert import check_experts_modules

FSDP2 = dict(type='MMFullyShard')
MOE = dict(type='Llama', moe=dict(num_experts=4))


def _check(world=2, model=MOE, wrapper=FSDP2, **parallel):
    parallel.setdefault('ep', 2)
    return check_layout(dict(model=model, model_wrapper_cfg=wrapper,
                             parallel=parallel), world)


def test_ep_inside_the_data_ranks():
    dims = _check(world=4).dims
    assert (dims.ep, dims.dp_shard, dims.dp, dims.dp_cp, dims.efsdp) == (
        2, 2, 4, 4, 2)


def test_ep_inside_hsdp():
    """dp_replicate x ep: the experts replicated over dp_replicate, the
    shard axes but ep (efsdp) one rank."""
    dims = _check(world=4, dp_replicate=2).dims
    assert (dims.dp_replicate, dims.ep, dims.dp_shard, dims.dp,
            dims.efsdp) == (2, 2, 1, 4, 1)


@pytest.mark.parametrize('balance', ['bias', 'aux_loss'])
def test_ep_with_cp_balanced(balance):
    """Either balancing: the auxiliary loss sums each sequence's counts
    over the cp ranks (tests/tools/test_ep_end_to_end.py)."""
    dims = _check(world=4, cp=2,
                  model=dict(type='Llama', moe=dict(balance=balance))).dims
    assert (dims.ep, dims.cp, dims.dp, dims.efsdp) == (2, 2, 2, 2)


def test_ep_with_pp_without_balancing():
    dims = _check(world=4, pp=2, pipeline=dict(schedule='1F1B'),
                  model=dict(type='Llama', moe=dict(balance=None))).dims
    assert (dims.ep, dims.pp, dims.dp_shard, dims.efsdp) == (2, 2, 1, 1)


def test_ep_with_tp():
    """ep x tp: the tp pairs read the same samples (dp = ep), the experts
    split over ep only (efsdp one rank)."""
    dims = _check(world=4, tp=2, tp_plan='llama').dims
    assert (dims.ep, dims.tp, dims.dp, dims.dp_cp, dims.efsdp) == (
        2, 2, 2, 2, 1)


@pytest.mark.parametrize('kwargs,message', [
    (dict(model=dict(type='Llama')), "parallel.ep=2 is not allowed; "
     "model.type='Llama' has no mixture-of-experts layers"),
    (dict(model=None), 'parallel.ep=2 is not allowed; model.type=None has '
     'no mixture-of-experts layers'),
    (dict(model=dict(type='Llama', moe=dict(num_experts=3))),
     'model.moe.num_experts=3 is not allowed; parallel.ep=2 splits'),
    (dict(wrapper=None), "model_wrapper_cfg.type='MMDistributedDataParallel'"
     ' cannot wrap an expert-parallel model'),
    (dict(world=4, dp_replicate=2,
          wrapper=dict(FSDP2, sharding_strategy='HYBRID_SHARD')),
     "model_wrapper_cfg.sharding_strategy='HYBRID_SHARD' with parallel.ep=2"
     ' is not supported yet'),
    (dict(world=3), 'world size 3 is not divisible by'),
    (dict(world=4, pp=2, pipeline=dict(schedule='1F1B')),
     "model.moe.balance='aux_loss' is not allowed; with parallel.pp=2 and "
     'parallel.ep=2 a pipeline stage'),
    # pp alone (ep=1): the stages drop the auxiliary loss just the same
    (dict(ep=1, world=2, pp=2, pipeline=dict(schedule='1F1B')),
     "model.moe.balance='aux_loss' is not allowed; with parallel.pp=2 a "
     'pipeline stage'),
])
def test_refused_naming_the_key(kwargs, message):
    with pytest.raises((ConfigError, ValueError)) as err:
        _check(**kwargs)
    assert message in str(err.value)


class _Experts(torch.nn.Module):
    expert_parallel_params = ('up', 'down')

    def __init__(self, up=(4, 8, 8), down=(4, 8, 8), extra=False):
        super().__init__()
        self.up = torch.nn.Parameter(torch.zeros(up))
        self.down = torch.nn.Parameter(torch.zeros(down))
        if extra:
            self.gate = torch.nn.Linear(8, 4)


def _model(experts):
    model = torch.nn.Module()
    model.experts = experts
    return model


def test_a_protocol_module_is_found_with_its_stacked_params():
    experts = _Experts()
    assert check_experts_modules(_model(experts), 2) == [
        ('experts', experts, ('up', 'down'))]


def _declaring(names):
    experts = _Experts()
    experts.expert_parallel_params = names
    return experts


@pytest.mark.parametrize('model,message', [
    (torch.nn.Linear(4, 4), 'parallel.ep=2 is not allowed for model Linear:'
     ' none of its modules declares expert_parallel_params'),
    (_model(_declaring(('up', 'w9'))), "parallel.ep=2: experts (_Experts) "
     "declares expert_parallel_params 'w9', which is not a parameter"),
    (_model(_declaring('up')), "experts (_Experts).expert_parallel_params="
     "'up' is not allowed"),
    (_model(_Experts(down=(2, 8, 8))), "stack [2, 4] experts on dim 0"),
    (_model(_Experts(extra=True)), "has parameters ['gate.bias', "
     "'gate.weight'] besides its experts"),
    (_model(_Experts(up=(3, 8, 8), down=(3, 8, 8))), 'parallel.ep=2 does '
     'not divide the 3 experts of experts (_Experts)'),
])
def test_protocol_breaches_are_refused_naming_the_module(model, message):
    with pytest.raises(ConfigError) as err:
        check_experts_modules(model, 2)
    assert message in str(err.value)


def test_a_users_model_is_left_to_the_build_check():
    """A model class without mmpar's ``moe`` key passes the start-up check
    (its experts modules are checked when it is built)."""
    assert _check(model=dict(type='DigitsViT')).dims.ep == 2


def test_experts_split_by_a_tp_plan_are_refused(tmp_path):
    """A tp plan that made the experts DTensors (over tp) is refused before
    ep shards them again, naming both keys and the module."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/pg',
                            rank=0, world_size=1)
    experts = _Experts()
    experts.up = torch.nn.Parameter(distribute_tensor(
        experts.up.data, init_device_mesh('cpu', (1, )), [Shard(2)]))
    with pytest.raises(ConfigError) as err:
        check_experts_modules(_model(experts), 2)
    assert "parallel.ep=2: parallel.tp_plan splits the experts ['up'] of " \
        'experts (_Experts) over tp' in str(err.value)
