"""MMEngine's parameter rules see the plain model under every layout.

The ConvNeXt-V2 look-alike of tests/convnext_toy.py with its recipe's
``paramwise_cfg`` (norm, bias and flat decay off, plus a dwconv, bias-lr and
custom-key rule) and with a layer-wise lr decay constructor: each parameter's
lr and weight decay under DDP, FSDP1 (whose parameters are 1-D views of flat
parameters), FSDP2, tp=2 and pp=2, built by mmpar's Runner on 2 gloo ranks,
equal one process's; FSDP1 then trains like DDP. The tools' launch with a
``paramwise_cfg`` is tests/tools/test_documented_options.py's ``fsdp1``.
"""
import copy

import pytest
import torch
from mmengine.config import Config
from mmengine.optim import (DefaultOptimWrapperConstructor,
                            build_optim_wrapper)
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

from mmpar.failures import ConfigError
from mmpar.runner.optim import mmpar_optim_wrapper_cfg
from mmpar.runner.param_groups import (build_with_plain_rules, names_rules,
                                       plain_view)
from tests.convnext_toy import (LAYER_DECAY, OPTIM_WRAPPER, TP_PLAN,
                                ToyConvNeXtV2, named_options)
from tests.e2e import ROOT

CONFIGS = {'recipe': OPTIM_WRAPPER, 'layer_decay': LAYER_DECAY}
BLOCKS = dict(type='module_class', module_classes=['Block'])
LAYOUTS = {
    'ddp': {},
    'fsdp1': dict(model_wrapper_cfg=dict(
        type='MMFullyShardedDataParallel', fsdp_auto_wrap_policy=BLOCKS)),
    'fsdp2': dict(model_wrapper_cfg=dict(
        type='MMFullyShard', fsdp_auto_wrap_policy=BLOCKS)),
    'tp2': dict(parallel=dict(tp=2, tp_plan=TP_PLAN)),
    'pp2': dict(parallel=dict(pp=2, pipeline=dict(schedule='1F1B',
                                                  num_microbatches=2))),
    # Two stages a rank: the optimizer holds both stage copies.
    'pp2_virtual': dict(parallel=dict(pp=2, pipeline=dict(
        schedule='Interleaved1F1B', num_microbatches=2, stages_per_rank=2))),
}
ITERS = 3


def one_process_options(name: str) -> dict:
    """MMEngine's own constructor on the plain model."""
    model = ToyConvNeXtV2()
    return named_options(
        model, build_optim_wrapper(model, CONFIGS[name]).optimizer)


# ------------------------------------------------------------ one process


def test_view_is_the_plain_model_without_memory():
    model = ToyConvNeXtV2()
    model.head[2].weight = model.head[0].weight = nn.Parameter(
        torch.ones(16, 8))
    model.norm.weight.requires_grad_(False)
    view = plain_view(model)
    assert [(n, p.shape, p.requires_grad, p.is_meta, type(m))
            for (n, p), m in zip(view.named_parameters(), view.modules())] \
        == [(n, p.shape, p.requires_grad, True, type(m))
            for (n, p), m in zip(model.named_parameters(), model.modules())]
    assert view.head[2].weight is view.head[0].weight  # ties kept
    assert view.blocks[0].dwconv.groups == 8
    assert not model.stem[0].weight.is_meta  # the model is untouched
    # Only a config with rules makes the Runner take the view.
    assert names_rules(OPTIM_WRAPPER) and names_rules(LAYER_DECAY)
    assert not names_rules(dict(OPTIM_WRAPPER, paramwise_cfg=None))


def test_bypass_duplicate_and_custom_keys_as_one_process():
    """A tied parameter with ``bypass_duplicate``: the options of its first
    occurrence, as MMEngine gives them."""
    model = ToyConvNeXtV2()
    model.head[2].weight = nn.Parameter(torch.randn(8, 16))
    model.blocks[1].pwconv2.weight = model.head[2].weight
    cfg = dict(OPTIM_WRAPPER, paramwise_cfg=dict(
        OPTIM_WRAPPER['paramwise_cfg'], bypass_duplicate=True,
        custom_keys={'blocks.1': dict(lr_mult=0.1, momentum=0.5)}))
    expected = named_options(model, build_optim_wrapper(model, cfg)
                             .optimizer)
    built = build_with_plain_rules(mmpar_optim_wrapper_cfg(cfg),
                                   plain_view(model), model, model)
    assert named_options(model, built.optimizer) == expected
    assert expected['head.2.weight'][0] == pytest.approx(0.001)
    assert [g.get('momentum') for g in built.optimizer.param_groups] == [
        g.get('momentum') for g in build_optim_wrapper(model, cfg)
        .optimizer.param_groups]


@OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
class OwnCallConstructor(DefaultOptimWrapperConstructor):
    """Makes its groups in its own ``__call__``, out of mmpar's reach."""

    def __call__(self, model):
        return super().__call__(model)


def test_own_call_constructor_refused_where_shapes_change():
    """Such a constructor sees the laid-out parameters: fine where they
    keep their shapes, refused where they do not (FSDP1's 1-D views; here
    a model of another width stands in)."""
    cfg = dict(OPTIM_WRAPPER, constructor='OwnCallConstructor')
    model = ToyConvNeXtV2()
    built = build_with_plain_rules(cfg, plain_view(model), model, model)
    assert named_options(model, built.optimizer) == one_process_options(
        'recipe')
    with pytest.raises(ConfigError, match='optim_wrapper.constructor'):
        build_with_plain_rules(cfg, plain_view(ToyConvNeXtV2(dim=4)),
                               model, model)


# --------------------------------------------------------- every layout


def _cfg(work_dir, name, optim_wrapper, **extra):
    cfg = Config.fromfile(str(ROOT / 'configs/vit_digits/vit_digits_iter.py'))
    cfg.model = dict(type='ToyConvNeXtV2')
    cfg.optim_wrapper = optim_wrapper
    cfg.param_scheduler = None
    cfg.train_cfg = dict(by_epoch=False, max_iters=ITERS)
    cfg.train_dataloader.batch_size = 16
    cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    cfg.default_hooks.checkpoint = None
    cfg.launcher = 'pytorch'
    cfg.work_dir = str(work_dir)
    cfg.experiment_name = name  # unique: MMEngine keeps loggers by name
    cfg.update(extra)
    return cfg


def _options_under(layout: str, work_dir: str) -> dict:
    from mmpar.runner import Runner
    runner = Runner.from_cfg(_cfg(work_dir, f'groups_{layout}', OPTIM_WRAPPER,
                                  **LAYOUTS[layout]))
    return {name: named_options(runner.model, runner.build_optim_wrapper(
        copy.deepcopy(cfg)).optimizer) for name, cfg in CONFIGS.items()}


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_groups_equal_one_process_under(run_dist, tmp_path, layout):
    ranks = run_dist(_options_under, layout, str(tmp_path))
    for name in CONFIGS:
        expected = one_process_options(name)
        seen = {}
        for options in ranks:
            assert options[name].items() <= expected.items(), name
            seen.update(options[name])
        # Every parameter on some rank (a pp rank holds its stages only).
        assert seen == expected, name
    if not layout.startswith('pp'):
        assert all(set(r['recipe']) == set(expected) for r in ranks)


def _refusal_without_orig_params(work_dir: str) -> str:
    from mmpar.runner import Runner
    runner = Runner.from_cfg(_cfg(
        work_dir, 'groups_flat', OPTIM_WRAPPER, model_wrapper_cfg=dict(
            type='MMFullyShardedDataParallel', use_orig_params=False)))
    try:
        runner.build_optim_wrapper(copy.deepcopy(OPTIM_WRAPPER))
    except ConfigError as err:
        return str(err)
    return 'built'


def test_fsdp1_without_orig_params_refuses_the_rules(run_dist, tmp_path):
    """FSDP1 with ``use_orig_params=False`` holds flat parameters only:
    no per-parameter group can exist, so the rules are refused."""
    for message in run_dist(_refusal_without_orig_params, str(tmp_path)):
        assert message.startswith('optim_wrapper.paramwise_cfg'), message
        assert 'use_orig_params=True' in message


def _trained(layout: str, work_dir: str) -> dict:
    from mmpar.runner import Runner
    from mmpar.wrappers.base import describe
    from mmpar.wrappers.full_state import full_state_dict
    runner = Runner.from_cfg(_cfg(work_dir, f'train_{layout}', OPTIM_WRAPPER,
                                  **LAYOUTS[layout]))
    runner.train()
    return full_state_dict(describe(runner.model).state_module)


def test_fsdp1_trains_like_ddp(run_dist, tmp_path):
    """Bit for bit: on 2 ranks a reduce-scatter and an all-reduce add the
    same two numbers, and the rules now give every parameter DDP's decay."""
    ddp = run_dist(_trained, 'ddp', str(tmp_path / 'ddp'))[0]
    fsdp1 = run_dist(_trained, 'fsdp1', str(tmp_path / 'fsdp1'))[0]
    assert fsdp1.keys() == ddp.keys()
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp1[key], value, atol=0, rtol=0,
                                   msg=lambda m, key=key: f'{key}: {m}')
