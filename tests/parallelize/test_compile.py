"""apply_compile: per-block torch.compile from config, parity with eager
training at world size 1 and 2 (DDP, FSDP2), accumulation and clipping on.

The compiled runs use the ``aot_eager`` backend (chosen from the config
dict): it traces forward and backward through dynamo and AOTAutograd as
inductor does, without inductor's C++ code generation, which takes minutes on
2 shared CPU cores. The backend is the only difference from production use.
"""
import pytest
import torch
import torch.distributed as dist

from mmpar.config_check import check_config
from mmpar.failures import ConfigError
from mmpar.models import Llama, LlamaBlock
from mmpar.parallelize.compile import (apply_compile, check_compile_cfg,
                                       find_blocks)
from mmpar.wrappers import build_model_wrapper
from tests.lm_toy import make_token_batches
from tests.toy import (assert_states_close, make_optim_wrapper, shard_batch,
                       train_reference)

COMPILE = dict(per_block=True, backend='aot_eager')
OPTIM = dict(accumulative_counts=2, clip=0.05)


def _model():
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, num_layers=2, num_heads=2,
                 max_seq_len=16)


def test_blocks_are_found_and_names_kept():
    model = _model()
    keys = list(model.state_dict())
    blocks = find_blocks(model)
    assert blocks == list(model.layers.values())
    assert find_blocks(model, ['LlamaBlock']) == blocks
    apply_compile(model, COMPILE)
    assert list(model.state_dict()) == keys
    assert all(type(b) is LlamaBlock for b in model.layers.values())


def test_no_blocks_names_the_fix():
    with pytest.raises(ValueError, match='module_classes'):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize('cfg,match', [
    (dict(per_blok=True), "unknown key.*per_blok"),
    (dict(per_block='yes'), 'per_block'),
    (dict(module_classes='LlamaBlock'), 'module_classes'),
    (dict(backend='nope'), "backend='nope'"),
    (dict(mode='reduce-overhed'), "refuses {'mode': 'reduce-overhed'}: "
     'Unrecognized mode'),
    (dict(mode='default', options={}), "refuses .*'options'"),
    ('fast', 'must be a dict'),
])
def test_bad_cfg_names_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        check_compile_cfg(cfg)


def test_config_check_refuses_at_start_up():
    with pytest.raises(ConfigError, match='model_compile.*per_blok'):
        check_config(dict(model=dict(type='Llama'),
                          model_compile=dict(per_blok=True)))
    assert check_compile_cfg(True) == dict(per_block=True)
    assert check_compile_cfg(False) is None


def test_one_process_parity():
    batches = make_token_batches()
    expected = train_reference(_model(), batches, **OPTIM)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = apply_compile(_model(), COMPILE)
    optim_wrapper = make_optim_wrapper(model, **OPTIM)
    for batch in batches:
        model.train_step(batch, optim_wrapper)
    # It really compiled: one graph serves both blocks.
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] == 1
    assert_states_close(model.state_dict(), expected, atol=1e-6, rtol=1e-5)
    assert not torch.equal(expected['output.weight'],
                           _model().state_dict()['output.weight'])


def _train_compiled(wrapper_cfg, batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = apply_compile(_model(), COMPILE)
    wrapper = build_model_wrapper(wrapper_cfg, model)
    optim_wrapper = make_optim_wrapper(wrapper.module, **OPTIM)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    if hasattr(wrapper, 'full_state_dict'):
        return wrapper.full_state_dict()
    return {k: v.detach().clone() for k, v in wrapper.module.state_dict()
            .items()}


@pytest.mark.parametrize('wrapper_cfg', [
    dict(type='MMDistributedDataParallel'),
    dict(type='MMFullyShard', fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock'])),
], ids=['ddp', 'fsdp2'])
def test_two_rank_parity(run_dist, wrapper_cfg):
    batches = make_token_batches()
    expected = train_reference(_model(), batches, **OPTIM)
    for state in run_dist(_train_compiled, wrapper_cfg, batches):
        assert_states_close(state, expected, atol=1e-6, rtol=1e-5)


def test_runner_compiles_from_config(tmp_path):
    from tests.configs.test_llama_configs import _train
    result = _train('configs/llama_shakespeare/llama_shakespeare.py',
                    tmp_path, 'compile_runner', max_iters=2,
                    model_compile=COMPILE)
    assert result['val_loss'] > 0
