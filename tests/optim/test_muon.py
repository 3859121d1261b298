"""Muon from a plain config, one process: the routing rule, bit-identical
weights to torch.optim.Muon + torch.optim.AdamW, checkpoints, schedulers,
and the errors. The layouts: tests/optim/test_muon_layouts.py."""
import copy
import re

import pytest
import torch
from mmengine.optim import build_optim_wrapper
from mmengine.optim.scheduler import LinearLR

from mmpar.failures import ConfigError
from mmpar.models.llama import Llama
from mmpar.optim import Muon, WholeMatrixOptimizer
from mmpar.optim.matrix_constructor import ADAMW_MODULES, route
from mmpar.optim.muon import newton_schulz
from mmpar.optim.whole_matrix import assign_owners, chunk_sizes
from mmpar.registry import OPTIMIZERS
from mmpar.runner.optim import mmpar_optim_wrapper_cfg

SHORTEST = dict(optimizer=dict(type='Muon', lr=0.02))
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)


def tiny_llama(seed: int = 0, **kwargs) -> Llama:
    torch.manual_seed(seed)
    return Llama(vocab_size=32, dim=16, num_layers=2, num_heads=2,
                 max_seq_len=8, **kwargs)


def built(model, cfg):
    """What mmpar's Runner builds for ``cfg``."""
    return build_optim_wrapper(model, mmpar_optim_wrapper_cfg(cfg))


def matrices(model):
    return [n for n, p in model.named_parameters()
            if route(model, ADAMW_MODULES)[id(p)]]


def loss_of(model, step: int):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 32, (2, 9), generator=gen)
    return model(tokens[:, :-1], tokens[:, 1:], mode='loss')['loss']


def test_routing_rule_on_llama():
    """Muon takes the blocks' projections; AdamW the embedding, the head
    (``output``), the norms."""
    model = tiny_llama()
    assert matrices(model) == [
        f'layers.{i}.{m}.weight' for i in range(2)
        for m in ('attn.wq', 'attn.wk', 'attn.wv', 'attn.wo', 'mlp.w1',
                  'mlp.w3', 'mlp.w2')
    ]
    tied = tiny_llama(tie_embeddings=True)
    assert 'output.weight' not in matrices(tied)


def test_shortest_config_equals_torch_muon_and_adamw():
    """``optimizer=dict(type='Muon', lr=0.02, adamw=...)``, bit for bit
    (atol=rtol=0) torch.optim.Muon on the routed matrices and
    torch.optim.AdamW on the rest, over 3 steps."""
    model, reference = tiny_llama(), tiny_llama()
    cfg = dict(optimizer=dict(type='Muon', lr=0.02, adamw=ADAMW))
    wrapper = built(model, cfg)
    assert isinstance(wrapper.optimizer, Muon)
    routes = route(reference, ADAMW_MODULES)
    ours = [p for p in reference.parameters() if routes[id(p)]]
    rest = [p for p in reference.parameters() if not routes[id(p)]]
    torch_optims = [torch.optim.Muon(ours, lr=0.02),
                    torch.optim.AdamW(rest, **ADAMW)]
    for step in range(3):
        wrapper.update_params(loss_of(model, step))
        loss_of(reference, step).backward()
        for optim in torch_optims:
            optim.step()
            optim.zero_grad()
    for (name, a), b in zip(model.named_parameters(),
                            reference.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    # The shortest config builds too (torch's AdamW defaults).
    assert built(tiny_llama(), SHORTEST).optimizer.param_groups[1][
        'lr'] == 1e-3


def test_state_dict_resumes_bit_exact_with_scheduler():
    """Both rules' state in one state_dict: 2 steps, save, load into a new
    optimizer, 2 more, equals 4 straight; a scheduler scales each group
    from its own lr."""
    cfg = dict(optimizer=dict(type='Muon', lr=0.02, adamw=ADAMW))

    def run(model, wrapper, steps):
        scheduler = LinearLR(wrapper, start_factor=0.5, by_epoch=False,
                             begin=0, end=4)
        for step in steps:
            wrapper.update_params(loss_of(model, step))
            scheduler.step()
        return scheduler

    straight = tiny_llama()
    run(straight, built(straight, cfg), range(4))
    model = tiny_llama()
    first = built(model, cfg)
    scheduler = run(model, first, range(2))
    state = copy.deepcopy(first.state_dict())
    keys = {k for s in state['state'].values() for k in s}
    assert keys == {'momentum_buffer', 'step', 'exp_avg', 'exp_avg_sq'}
    assert sorted({g['initial_lr'] for g in first.param_groups}) == [
        3e-3, 0.02]
    factors = [g['lr'] / g['initial_lr'] for g in first.param_groups]
    assert factors == pytest.approx([factors[0]] * len(factors))
    assert 0.5 < factors[0] < 1
    # The Runner's order: optim wrapper, schedulers, then the checkpoint.
    second = built(model, cfg)
    resumed = LinearLR(second, start_factor=0.5, by_epoch=False, begin=0,
                       end=4)
    second.load_state_dict(state)
    resumed.load_state_dict(scheduler.state_dict())
    for step in (2, 3):
        second.update_params(loss_of(model, step))
        resumed.step()
    for a, b in zip(model.parameters(), straight.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize('muon', [dict(lr=0.02),
                                  dict(lr=0.02, weight_decay=0.0),
                                  dict(lr=0.0, weight_decay=0.1)],
                         ids=['muon-defaults', 'muon-decay-0', 'muon-lr-0'])
def test_paramwise_cfg_scales_adamw_settings(muon):
    """A decay multiplier of 0 on 1-D parameters gives the norms no decay;
    an lr multiplier scales AdamW's lr for AdamW's parameters; also where
    Muon's own lr or decay is 0 (base x multiplier is 0 there, and AdamW's
    base used to apply)."""
    cfg = dict(optimizer=dict(type='Muon', adamw=ADAMW, **muon),
               paramwise_cfg=dict(flat_decay_mult=0.0, custom_keys={
                   'tok_embeddings': dict(lr_mult=0.5)}))
    model = tiny_llama()
    groups = built(model, cfg).optimizer.param_groups
    by_param = {id(p): g for g in groups for p in g['params']}
    embed = by_param[id(model.tok_embeddings.weight)]
    assert not embed['matrix'] and embed['lr'] == pytest.approx(1.5e-3)
    assert embed['weight_decay'] == ADAMW['weight_decay']
    assert by_param[id(model.norm.weight)]['weight_decay'] == 0
    wq = by_param[id(model.layers['0'].attn.wq.weight)]
    assert wq['matrix'] and wq['lr'] == muon['lr']
    assert wq['weight_decay'] == muon.get('weight_decay', 0.1)


@pytest.mark.parametrize('optimizer, match', [
    (dict(type='Muon', lr=0.02, adamw=dict(momentum=0.9)),
     r"optim_wrapper.optimizer: adamw: \['momentum'\]"),
    (dict(type='Muon', lr=0.02, adamw_modules='output'),
     'optim_wrapper.optimizer.adamw_modules'),
    (dict(type='Muon', lr=-1), 'optim_wrapper.optimizer: Muon: lr=-1'),
])
def test_bad_keys_name_the_key(optimizer, match):
    with pytest.raises(ConfigError, match=match):
        built(tiny_llama(), dict(optimizer=optimizer))


@pytest.mark.parametrize('adamw', [
    dict(lr=-1e-3), dict(betas=(1.5, 0.999)), dict(eps=-1.0),
    dict(betas=0.9)], ids=['lr', 'betas', 'eps', 'betas-not-a-pair'])
def test_adamw_values_torch_refuses_are_named_at_build(adamw):
    """Refused when the optimizer is built (they were accepted: a negative
    lr trained by gradient ascent, a bare beta failed in the first step)."""
    optimizer = dict(type='Muon', lr=0.02, adamw=adamw)
    with pytest.raises(ConfigError, match=re.escape(
            f'optim_wrapper.optimizer: adamw={adamw!r}: torch.optim.AdamW '
            'refuses it: ')):
        built(tiny_llama(), dict(optimizer=optimizer))


def test_newton_schulz_is_torch_muons():
    """The same operations as torch.optim.Muon's (one step, no momentum,
    no decay: the update is lr times the orthogonalised gradient); the
    largest shape runs mmpar.optim.bf16_matmul's products against torch's."""
    for shape in ((5, 3), (3, 7), (4, 4), (160, 96)):
        grad = torch.randn(shape)
        param = torch.nn.Parameter(torch.zeros(shape))
        param.grad = grad.clone()
        torch.optim.Muon([param], lr=1.0, weight_decay=0, momentum=0,
                         nesterov=False).step()
        scale = max(1, shape[0] / shape[1]) ** 0.5
        expected = -newton_schulz(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
        torch.testing.assert_close(param.data, expected.float() * scale,
                                   atol=0, rtol=0)


@pytest.mark.parametrize('nesterov', [False, True])
def test_bf16_momentum_buffer_holds_the_momentum(nesterov):
    """Newton-Schulz works on a copy: a bfloat16 parameter's momentum buffer
    after 3 steps is the momentum of its gradients, bit for bit (without
    nesterov the buffer is the matrix orthogonalised, and the in-place
    normalisation used to rescale it)."""
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 6, generator=gen).bfloat16())
    optimizer = Muon([param], lr=0.02, nesterov=nesterov)
    expected = torch.zeros(8, 6, dtype=torch.bfloat16)
    for _ in range(3):
        param.grad = torch.randn(8, 6, generator=gen).bfloat16()
        expected.lerp_(param.grad, 1 - 0.95)
        optimizer.step()
    torch.testing.assert_close(optimizer.state[param]['momentum_buffer'],
                               expected, atol=0, rtol=0)


def test_owners_and_chunks():
    assert chunk_sizes(5, 2) == [3, 2]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]
    # Largest first, each to the least-loaded rank: balanced work.
    assert assign_owners([10, 1, 9, 2], 2) == [0, 0, 1, 1]


@OPTIMIZERS.register_module(force=True)
class PolarSGD(WholeMatrixOptimizer):
    """docs/muon.md's plug-in example, without momentum: a step along the
    polar factor ``U V^T`` of the whole gradient."""

    def __init__(self, params, lr=0.01, adamw=None):
        super().__init__(params, dict(lr=lr), adamw)

    def prepare(self, param, grad, state, group):
        return grad

    def transform(self, matrix, group):
        u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u @ vh

    def apply(self, param, local, update, state, group):
        local.add_(update, alpha=-group['lr'])


def test_another_whole_matrix_optimizer_plugs_in():
    """A registered WholeMatrixOptimizer subclass, named in the config, gets
    the routing and the AdamW groups."""
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapper = built(model, dict(optimizer=dict(type='PolarSGD', lr=0.1)))
    groups = wrapper.optimizer.param_groups
    assert [g['matrix'] for g in groups] == [True, False]
    loss_of(model, 0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    wrapper.step()
    u, _, vh = torch.linalg.svd(grads['layers.0.attn.wq.weight'],
                                full_matrices=False)
    torch.testing.assert_close(
        model.layers['0'].attn.wq.weight.detach(),
        before['layers.0.attn.wq.weight'] - 0.1 * u @ vh)
    # AdamW's first step moves each element by about its lr (1e-3).
    moved = model.output.weight.detach() - before['output.weight']
    assert float(moved.abs().max()) == pytest.approx(1e-3, rel=0.05)


@pytest.mark.parametrize('matrix', [True, False, None])
def test_a_group_given_as_a_generator_keeps_its_parameters(matrix):
    """torch's idiom, ``dict(params=module.parameters(), ...)``: every
    parameter lands in a group (a generator is read once, not used up
    before torch's ``add_param_group`` sees it)."""
    layers = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False),
                                 torch.nn.Linear(3, 3))
    first, second = layers
    optim = Muon([first.weight], lr=0.02)
    extra = dict(params=second.parameters())  # a 2-D weight and a bias
    if matrix is not None:
        extra['params'] = (p for p in second.parameters()
                           if (p.ndim == 2) == matrix)
        extra['matrix'] = matrix
    optim.add_param_group(extra)
    held = [p for group in optim.param_groups for p in group['params']]
    expected = {True: 2, False: 2, None: 3}[matrix]
    assert len(held) == expected
    assert all(isinstance(g['params'], list) for g in optim.param_groups)
