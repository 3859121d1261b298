"""GAN training the MMEngine way: MMEngine's
``MMSeparateDistributedDataParallel`` (a DDP around each child, so the plain
``fc1.weight`` is named ``fc1.module.weight``) with a constructor that builds
an ``OptimWrapperDict`` in its own ``__call__``. The wrapper changes names,
not shapes, so mmpar builds the optimizers as MMEngine does and trains to
MMEngine's weights on 2 gloo ranks; a view of other shapes is still refused.
"""
import copy

import pytest
import torch
from mmengine.model import BaseModel
from mmengine.optim import (DefaultOptimWrapperConstructor, OptimWrapperDict,
                            build_optim_wrapper)
from mmengine.registry import DATASETS, MODELS, OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn
from torch.utils.data import Dataset

from mmpar.failures import ConfigError
from mmpar.runner.param_groups import build_with_plain_rules, plain_view


@MODELS.register_module(force=True)
class TwoNetGAN(BaseModel):
    """Two linear "networks", each stepped by its own optimizer."""

    def __init__(self, width: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.gen = nn.Linear(4, width)
        self.disc = nn.Linear(width, 2)

    def forward(self, inputs, labels=None, mode='tensor'):
        out = self.disc(torch.relu(self.gen(inputs)))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(out, labels))
        return out

    def train_step(self, data, optim_wrapper):
        data = self.data_preprocessor(data, True)
        log = {}
        for key, scale in (('gen', 1.0), ('disc', 2.0)):
            with optim_wrapper[key].optim_context(self):
                loss = self(**data, mode='loss')['loss'] * scale
            optim_wrapper[key].update_params(loss)
            log[key] = loss.detach()
        return log


@OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
class GenDiscConstructor:
    """A downstream multi-optimizer constructor (as MMEngine's
    ``MultiOptimWrapperConstructor``): its own ``__call__``."""

    def __init__(self, optim_wrapper_cfg, paramwise_cfg=None):
        self.cfg = optim_wrapper_cfg

    def __call__(self, model):
        model = getattr(model, 'module', model)
        return OptimWrapperDict(
            gen=build_optim_wrapper(model.gen, self.cfg['gen']),
            disc=build_optim_wrapper(model.disc, self.cfg['disc']))


@OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
class OwnCallDefaultConstructor(DefaultOptimWrapperConstructor):
    """MMEngine's constructor behind a ``__call__`` of its own."""

    def __call__(self, model):
        return super().__call__(model)


@DATASETS.register_module(force=True)
class FourFeatures(Dataset):

    def __init__(self, num_samples: int = 16):
        gen = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(num_samples, 4, generator=gen)
        self.labels = (self.inputs.sum(1) > 0).long()

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return dict(inputs=self.inputs[index], labels=self.labels[index])


GAN_OPTIM = dict(constructor='GenDiscConstructor',
                 gen=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
                 disc=dict(optimizer=dict(type='SGD', lr=0.05)))
SGD = dict(optimizer=dict(type='SGD', lr=0.1, weight_decay=1e-2))


def _children_wrapped(model: nn.Module) -> nn.Module:
    """What MMSeparateDistributedDataParallel makes of the model's children
    (``nn.DataParallel``, also an MMEngine model wrapper, runs in one CPU
    process)."""
    for name, child in list(model.named_children()):
        if name != 'data_preprocessor':
            setattr(model, name, nn.DataParallel(child))
    return model


def _options(optimizer) -> list:
    return [(tuple(p.shape), g['lr'], g['weight_decay'])
            for g in optimizer.param_groups for p in g['params']]


# ------------------------------------------------------------ one process


def test_own_call_constructor_under_wrapped_children():
    """Names gain ``.module.``, shapes stay: the constructor builds on the
    wrapped model (as under MMEngine); unfixed, it was refused as a
    layout that changes shapes."""
    view = plain_view(TwoNetGAN())
    model = _children_wrapped(TwoNetGAN())
    assert 'gen.module.weight' in dict(model.named_parameters())
    built = build_with_plain_rules(GAN_OPTIM, view, model, model)
    assert set(built.keys()) == {'gen', 'disc'}
    assert built['gen'].optimizer.param_groups[0]['params'][0] is \
        model.gen.module.weight
    # Other shapes behind the same names are still refused.
    with pytest.raises(ConfigError, match='optim_wrapper.constructor'):
        build_with_plain_rules(GAN_OPTIM, plain_view(TwoNetGAN(width=6)),
                               model, model)


def test_paramwise_rules_under_wrapped_children():
    """The rules, made on the plain names, reach the wrapped parameters."""
    cfg = dict(SGD, paramwise_cfg=dict(
        bias_decay_mult=0.0, custom_keys={'disc': dict(lr_mult=0.5)}))
    plain = TwoNetGAN()
    expected = _options(build_optim_wrapper(plain, copy.deepcopy(cfg))
                        .optimizer)
    model = _children_wrapped(TwoNetGAN())
    built = build_with_plain_rules(cfg, plain_view(TwoNetGAN()), model, model)
    assert sorted(_options(built.optimizer)) == sorted(expected)
    assert {id(p) for g in built.optimizer.param_groups for p in g['params']} \
        == {id(p) for p in model.parameters()}
    own_call = build_with_plain_rules(
        dict(cfg, constructor='OwnCallDefaultConstructor'),
        plain_view(TwoNetGAN()), model, model)
    assert len(own_call.optimizer.param_groups) == 4


# ------------------------------------------------------------ 2 gloo ranks


def _gan_cfg(work_dir: str, name: str):
    from mmengine.config import Config
    data = dict(batch_size=4, num_workers=0,
                dataset=dict(type='FourFeatures'),
                sampler=dict(type='DefaultSampler', shuffle=True),
                collate_fn=dict(type='default_collate'))
    return Config(dict(
        model=dict(type='TwoNetGAN'), work_dir=work_dir,
        experiment_name=name,  # unique: MMEngine keeps loggers by name
        train_dataloader=data, train_cfg=dict(by_epoch=True, max_epochs=2),
        optim_wrapper=copy.deepcopy(GAN_OPTIM),
        model_wrapper_cfg=dict(type='MMSeparateDistributedDataParallel'),
        default_hooks=dict(checkpoint=None), randomness=dict(seed=0),
        env_cfg=dict(dist_cfg=dict(backend='gloo')), launcher='pytorch',
        log_level='WARNING'))


def _trained_gan(runner_name: str, work_dir: str) -> dict:
    from mmengine.runner import Runner as MMEngineRunner

    from mmpar.runner import Runner
    cfg = _gan_cfg(work_dir, f'separate_gan_{runner_name}')
    if runner_name == 'mmengine':
        # MMEngine's wrapper asks for this rank's GPU unless told the module
        # stays on the CPU.
        cfg.model_wrapper_cfg.device_ids = None
    cls = MMEngineRunner if runner_name == 'mmengine' else Runner
    runner = cls.from_cfg(cfg)
    runner.train()
    return {k: v.detach().clone()
            for k, v in runner.model.module.state_dict().items()}


def test_separate_ddp_gan_trains_as_under_mmengine(run_dist, tmp_path):
    mmengine_ranks = run_dist(_trained_gan, 'mmengine',
                              str(tmp_path / 'mmengine'))
    ours_ranks = run_dist(_trained_gan, 'mmpar', str(tmp_path / 'mmpar'))
    expected = mmengine_ranks[0]
    assert 'gen.module.weight' in expected
    for ours in ours_ranks:
        assert ours.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(ours[key], value, atol=0, rtol=0,
                                       msg=lambda m, key=key: f'{key}: {m}')
