"""Activation checkpointing as its own step: every mode leaves the
gradients unchanged; full recomputes each block, selective only the cheap
ops; and the plan's activation estimate ranks the modes as they save."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmpar.failures import ConfigError
from mmpar.parallelize.activation import (apply_activation_checkpointing,
                                          check_activation_checkpointing)
from mmpar.registry import MODELS

LLAMA = dict(type='Llama', vocab_size=64, dim=64, num_layers=4, num_heads=4,
             max_seq_len=32)
BLOCKS = dict(module_classes=['LlamaBlock'])


class _CountMatmuls(TorchDispatchMode):

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads_and_backward_matmuls(ac_cfg):
    torch.manual_seed(0)
    model = apply_activation_checkpointing(MODELS.build(dict(LLAMA)),
                                           ac_cfg)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator()
                           .manual_seed(1))
    loss = model(tokens, tokens, mode='loss')['loss']
    counter = _CountMatmuls()
    with counter:
        loss.backward()
    grads = {n.replace('_checkpoint_wrapped_module.', ''): p.grad
             for n, p in model.named_parameters()}
    return grads, counter.count


def test_every_mode_leaves_gradients_unchanged_and_recomputes_as_said():
    expected, plain = _grads_and_backward_matmuls(None)
    counts = {}
    for name, cfg in [('full', BLOCKS), ('every2', dict(BLOCKS, every=2)),
                      ('selective', dict(BLOCKS, mode='selective'))]:
        grads, counts[name] = _grads_and_backward_matmuls(cfg)
        for key, value in expected.items():
            assert torch.equal(grads[key], value), (name, key)
    # Full recomputes every block's projections in backward, every 2nd
    # block half as many; selective keeps matmul outputs and reruns none.
    recomputed = counts['full'] - plain
    assert recomputed > 0 and recomputed % 4 == 0  # the same per block
    assert counts['every2'] - plain == recomputed // 2
    assert counts['selective'] == plain


@pytest.mark.parametrize('cfg,match', [
    (dict(BLOCKS, mode='partial'), "mode='partial'"),
    (dict(BLOCKS, every=0), 'every=0'),
    (dict(BLOCKS, save_ops=['aten.mm.default']), "needs mode='selective'"),
    (dict(BLOCKS, mode='selective', save_ops=['aten.nope.default']),
     'aten.nope.default'),
    (dict(BLOCKS, depth=2), 'depth'),
    (3, 'activation_checkpointing=3'),
])
def test_bad_settings_name_the_key(cfg, match):
    with pytest.raises((TypeError, ValueError), match=match):
        check_activation_checkpointing(cfg)


def test_config_check_refuses_both_spellings():
    from mmpar.config_check import check_layout
    with pytest.raises(ConfigError, match='are both set'):
        check_layout(dict(
            activation_checkpointing=BLOCKS,
            model_wrapper_cfg=dict(type='MMFullyShard',
                                   activation_checkpointing=['LlamaBlock'])))


def test_estimate_ranks_the_modes_by_what_they_keep():
    from mmpar.analysis.activations import activation_bytes
    cfg = dict(LLAMA, dim=128, max_seq_len=64)
    none, full, every2, selective = (
        activation_bytes(copy.deepcopy(cfg), 4, 64, ac)
        for ac in (None, BLOCKS, dict(BLOCKS, every=2),
                   dict(BLOCKS, mode='selective')))
    assert full < selective < none
    assert full < every2 < none
