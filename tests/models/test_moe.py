"""The MoE block of the Llama: grouped matmul against the per-expert loop,
routing, balancing and the config keys (in-process, one rank)."""
import re

import pytest
import torch

from mmpar.models import Llama
from mmpar.models.moe import MoEConfig, expert_swiglu, grouped_mm_runs

TINY = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, hidden_dim=32,
            max_seq_len=16)


def _weights(num_experts=4, dim=32, hidden=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(num_experts, a, b, generator=g, dtype=dtype)
            .requires_grad_() for a, b in ((dim, hidden), (dim, hidden),
                                           (hidden, dim))]


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_grouped_mm_and_the_loop_agree_bit_for_bit(dtype):
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 32, dtype=dtype, requires_grad=True)
    grad = torch.randn(10, 32, dtype=dtype)
    results = []
    for grouped in (True, False):
        weights = _weights(dtype=dtype)
        assert grouped_mm_runs(x, *weights)
        x.grad = None
        out = expert_swiglu(x, counts, *weights, grouped_mm=grouped)
        (out * grad).sum().backward()
        results.append([out, x.grad] + [w.grad for w in weights])
    for grouped, loop in zip(*results):
        assert torch.equal(grouped, loop)


def test_grouped_mm_is_skipped_where_rows_are_not_aligned():
    x = torch.randn(6, 7)
    weights = _weights(dim=7, hidden=5)
    assert not grouped_mm_runs(x, *weights)
    out = expert_swiglu(x, torch.tensor([2, 2, 1, 1]), *weights)
    assert out.shape == (6, 7)


def _model(**moe):
    torch.manual_seed(0)
    return Llama(**TINY, moe=dict(num_experts=4, top_k=2, **moe))


def _loss(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 9), generator=g)
    return model(tokens[:, :-1], tokens[:, 1:], mode='loss')


@pytest.mark.parametrize('moe', [
    dict(), dict(score_func='sigmoid', shared_expert=True),
    dict(balance='bias'), dict(force_balanced=True, balance=None)])
def test_moe_llama_trains_and_logs(moe):
    model = _model(**moe)
    model.train()
    out = _loss(model)
    counts = [out[f'moe_tokens_e{i}'] for i in range(4)]
    # 2 layers x 16 tokens x top 2.
    assert sum(c.item() for c in counts) == 2 * 16 * 2
    if moe.get('force_balanced'):
        assert all(c.item() == 16 for c in counts)
    assert ('moe_aux_loss' in out) == (moe.get('balance', 'aux_loss') ==
                                       'aux_loss')
    loss = sum(v for k, v in out.items() if 'loss' in k)
    loss.backward()
    assert model.layers['0'].mlp.router.weight.grad.abs().sum() > 0
    assert model.layers['0'].mlp.experts.w2.grad.abs().sum() > 0


def test_bias_balancing_moves_towards_the_mean_load():
    model = _model(balance='bias', bias_update_rate=0.1)
    model.train()
    _loss(model)
    moe = model.layers['0'].mlp
    counts = moe.tokens_per_expert.float()
    _loss(model, seed=2)  # the update uses the last forward's loads
    expected = 0.1 * torch.sign(counts.mean() - counts)
    assert torch.equal(moe.expert_bias, expected)
    assert not moe.expert_bias.requires_grad


def test_aux_loss_is_a_mean_over_sequences():
    # Per sequence: half the batch's loss term is that of each half.
    model = _model()
    model.train()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (4, 9), generator=g)
    whole = model(tokens[:, :-1], tokens[:, 1:], mode='loss')['moe_aux_loss']
    halves = [model(t[:, :-1], t[:, 1:], mode='loss')['moe_aux_loss']
              for t in tokens.split(2)]
    torch.testing.assert_close(whole, sum(halves) / 2)


@pytest.mark.parametrize('moe,key', [
    (dict(num_experts=0), 'model.moe.num_experts=0'),
    (dict(top_k=5), 'model.moe.top_k=5'),
    (dict(score_func='relu'), "model.moe.score_func='relu'"),
    (dict(balance='loss'), "model.moe.balance='loss'"),
    (dict(experts=4), 'model.moe.experts'),
    (dict(force_balanced='yes'), "model.moe.force_balanced='yes'"),
])
def test_bad_moe_keys_are_named(moe, key):
    with pytest.raises(ValueError, match=key.replace('.', r'\.')
                       .replace('(', r'\(')):
        MoEConfig.from_cfg(dict(dict(num_experts=4), **moe))


def test_force_balanced_in_chosen_blocks_only():
    """``force_balanced=[1]``: block 1 routes evenly, block 0 by its
    scores (one run checks both routings); an index past the blocks is
    refused naming the key."""
    model = _model(force_balanced=[1])
    model.train()
    _loss(model)
    forced, natural = (model.layers[i].mlp for i in '10')
    assert forced.tokens_per_expert.tolist() == [8] * 4
    assert natural.tokens_per_expert.tolist() != [8] * 4
    assert sum(natural.tokens_per_expert.tolist()) == 16 * 2
    with pytest.raises(ValueError, match=r'model\.moe\.force_balanced=\[2\] '
                       r'is not allowed; allowed: block indices below '
                       r'model\.num_layers=2'):
        _model(force_balanced=[2])
    with pytest.raises(ValueError, match=re.escape(
            'model.moe.force_balanced=[-1] is not allowed; allowed: True, '
            'False or a list of block indices')):
        _model(force_balanced=[-1])


@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/pg',
                            rank=0, world_size=1)
    return init_device_mesh('cpu', (1, ))


@pytest.mark.parametrize('plan', ['llama', 'llama_no_sp'])
def test_llama_tp_plans_leave_the_moe_layers_whole(one_rank_mesh, plan):
    """The registered Llama plans split attention and leave each MoE layer
    (router, shared expert, experts) plain, so ep can split the experts and
    every tp rank runs the layer whole; the split model computes the same
    loss (tests/tools/test_ep_end_to_end.py: ep2_tp2 on 4 ranks)."""
    from torch.distributed.tensor import DTensor

    from mmpar.parallelize.tensor import split_model
    model = _model(shared_expert=True)
    want = _loss(model)['loss']
    labels = split_model(model, one_rank_mesh, plan)
    assert 'layers.0.attn.wq' in labels
    moe = model.layers['0'].mlp
    assert not any(isinstance(p, DTensor) for p in moe.parameters())
    assert isinstance(model.layers['0'].attn.wq.weight, DTensor)
    torch.testing.assert_close(_loss(model)['loss'], want)
