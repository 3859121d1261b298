"""Sharded and split models start where one process starts, in every loop.

MMEngine's ``Runner.train()`` builds the train loop before it calls
``init_weights()``; an iteration-based loop makes its data-loader iterator
then, which draws a seed from the generator. A model whose ``init_weights``
draws random numbers (timm's ViT: ``trunc_normal_``) trained through
``mmpar.Runner`` from a config must start from one process's weights and
generator state, and train within the parity tolerances, under FSDP2 (built
on meta and whole), FSDP1, tp=2 and pp=2, iteration-based, and FSDP2
epoch-based.
"""
from typing import Dict, Optional

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import trunc_normal_init
from torch import nn

from mmpar.models import DigitsViT
from mmpar.registry import HOOKS, MODELS
from tests.e2e import ROOT, VIT_FSDP1, VIT_FSDP2
from tests.toy import assert_states_close

# 360 images (the digits' validation split, trained on here): whole batches
# on one process and on 2 data ranks, so the global batches agree.
PER_RANK_BATCH = dict(iter=8, epoch=60)
FSDP2, FSDP1 = VIT_FSDP2, VIT_FSDP1
PP2 = dict(pp=2, pipeline=dict(split_points=['blocks.1'], schedule='1F1B',
                               num_microbatches=2))
# name: (loop, parallel, model_wrapper_cfg, meta_init, data ranks)
LAYOUTS = {
    'fsdp2_meta_iter': ('iter', None, FSDP2, True, 2),
    'fsdp2_whole_iter': ('iter', None, FSDP2, False, 2),
    'tp2_iter': ('iter', dict(tp=2, tp_plan='digits_vit'), None, True, 1),
    'pp2_iter': ('iter', PP2, None, True, 1),
    'fsdp2_meta_epoch': ('epoch', None, FSDP2, True, 2),
    'fsdp1_meta_iter': ('iter', None, FSDP1, True, 2),
}


@MODELS.register_module()
class DrawingInitViT(DigitsViT):
    """The digits ViT initialised as timm's ViT is: ``init_weights`` draws
    (torch's ``trunc_normal_``, and MMEngine's initialiser for the patch
    embedding)."""

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.2)
        nn.init.trunc_normal_(self.cls_token, std=0.2)
        trunc_normal_init(self.patch_embed, std=0.2, bias=0.1)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.2)
                nn.init.zeros_(module.bias)


@HOOKS.register_module()
class StartProbeHook(Hook):
    """The generator state and the plain model's weights as training starts
    (after init_weights), and the weights at its end."""

    def before_train(self, runner) -> None:
        self.rng = torch.get_rng_state()
        self.start = _plain_state(runner.model)

    def after_train(self, runner) -> None:
        self.end = _plain_state(runner.model)


def _plain_state(model) -> Dict[str, torch.Tensor]:
    from mmpar.checkpoint import model_state

    # (One process's state dict holds the live parameters: copies.)
    return {k: v.clone() for k, v in model_state(model).items()}


def _cfg(work_dir: str, name: str, loop: str, batch: int,
         parallel: Optional[dict] = None, wrapper: Optional[dict] = None,
         meta_init: bool = True, launcher: str = 'pytorch') -> Config:
    cfg = Config.fromfile(str(ROOT / 'configs/vit_digits/vit_digits.py'))
    cfg.model = dict(type='DrawingInitViT', embed_dim=16, depth=2,
                     num_heads=2, mlp_ratio=2.0)
    cfg.train_dataloader.dataset.split = 'val'
    cfg.train_dataloader.batch_size = batch
    if loop == 'iter':
        cfg.train_dataloader.sampler = dict(type='InfiniteSampler',
                                            shuffle=True)
        cfg.train_cfg = dict(by_epoch=False, max_iters=3)
        cfg.log_processor = dict(by_epoch=False)
    else:  # 360 / batch: 3 iterations
        cfg.train_cfg = dict(by_epoch=True, max_epochs=1)
    # SGD: Adam's normalised step turns round-off in a near-zero gradient
    # (the attention's key bias) into a step of the learning rate.
    cfg.optim_wrapper = dict(type='OptimWrapper', optimizer=dict(
        type='SGD', lr=0.05, momentum=0.9))
    cfg.param_scheduler = None
    cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    cfg.default_hooks.checkpoint = None
    cfg.custom_hooks = [dict(type='StartProbeHook')]
    if parallel is not None:
        cfg.parallel = parallel
    if wrapper is not None:
        cfg.model_wrapper_cfg = wrapper
    cfg.meta_init = meta_init
    cfg.launcher = launcher
    cfg.work_dir = work_dir
    cfg.experiment_name = name  # unique: MMEngine keeps loggers by name
    return cfg


def _train(cfg: Config) -> Dict[str, object]:
    from mmpar.runner import Runner
    runner = Runner.from_cfg(cfg)
    runner.train()
    probe = next(h for h in runner.hooks if isinstance(h, StartProbeHook))
    return dict(rng=probe.rng, start=probe.start, end=probe.end)


def _train_layout(work_dir: str, name: str) -> Dict[str, object]:
    loop, parallel, wrapper, meta_init, _ = LAYOUTS[name]
    return _train(_cfg(work_dir, name, loop, PER_RANK_BATCH[loop], parallel,
                       wrapper, meta_init))


_ONE_PROCESS = {}


def _one_process(loop: str, batch: int, tmp_path_factory):
    """One process (launcher none), trained once per loop and batch."""
    key = (loop, batch)
    if key not in _ONE_PROCESS:
        work_dir = tmp_path_factory.mktemp(f'one_{loop}_{batch}')
        _ONE_PROCESS[key] = _train(_cfg(
            str(work_dir), f'init_order_one_{loop}_{batch}', loop, batch,
            launcher='none'))
    return _ONE_PROCESS[key]


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_starts_and_trains_as_one_process(run_dist, tmp_path,
                                          tmp_path_factory, name):
    loop, parallel, _, _, data_ranks = LAYOUTS[name]
    split = (parallel or {}).get('tp', 1) * (parallel or {}).get('pp', 1)
    expected = _one_process(loop, PER_RANK_BATCH[loop] * data_ranks,
                            tmp_path_factory)
    for rank, got in enumerate(run_dist(_train_layout, str(tmp_path), name,
                                        world_size=data_ranks * split)):
        # init_weights ran where MMEngine runs it: the same draws, so the
        # same weights and the generator where one process leaves it.
        assert torch.equal(got['rng'], expected['rng']), rank
        assert got['start'].keys() == expected['start'].keys()
        for key, value in expected['start'].items():
            assert torch.equal(got['start'][key], value), (rank, key)
        assert_states_close(got['end'], expected['end'], atol=1e-6,
                            rtol=1e-5)
