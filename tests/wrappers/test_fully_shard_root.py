"""MMFullyShard's root keeps its own parameters gathered from forward to
backward (torch's default for a root, torchtitan's choice): one all-gather
per unit in forward and one per block unit in backward, as plain
``fully_shard``. Counted on the ``fake`` backend (world size 2, one
process): the FSDP2 collectives run as calls, without communication."""
import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)


def _llama():
    from mmpar.models.llama import Llama
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, num_layers=3, num_heads=4,
                 max_seq_len=16)


def _all_gathers(model, step) -> int:
    calls = []
    original = dist.all_gather_single  # what FSDP2 calls (torch 2.13)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather_single = counted
    try:
        step()
    finally:
        dist.all_gather_single = original
    return len(calls)


def _loss_step(forward):
    tokens = torch.randint(0, 64, (2, 16))
    forward(tokens, tokens, mode='loss')['loss'].backward()


POLICY = dict(type='module_class', module_classes=['LlamaBlock'])


@pytest.mark.parametrize('wrapper_kwargs,expected', [
    # Forward: the root and 3 blocks; backward: the 3 blocks again.
    (dict(fsdp_auto_wrap_policy=POLICY), 4 + 3),
    # Asked for: the root re-gathered in backward too.
    (dict(fsdp_auto_wrap_policy=POLICY, reshard_after_forward=True), 4 + 4),
    # SHARD_GRAD_OP keeps every unit: forward only.
    (dict(fsdp_auto_wrap_policy=POLICY, sharding_strategy='SHARD_GRAD_OP'),
     4),
    # The root as the only unit keeps FULL_SHARD's resharding.
    (dict(), 1 + 1),
])
def test_all_gathers_per_step(fake_world, wrapper_kwargs, expected):
    from mmpar.wrappers.fully_shard import MMFullyShard
    wrapper = MMFullyShard(_llama(), **wrapper_kwargs)
    _loss_step(wrapper)  # lazy init
    assert _all_gathers(wrapper, lambda: _loss_step(wrapper)) == expected


def test_as_many_all_gathers_as_plain_fully_shard(fake_world):
    from torch.distributed.fsdp import fully_shard

    from mmpar.wrappers.fully_shard import MMFullyShard
    plain = _llama()
    for block in plain.layers.values():
        fully_shard(block)
    fully_shard(plain)
    wrapper = MMFullyShard(_llama(), fsdp_auto_wrap_policy=POLICY)
    for model in (plain, wrapper):
        _loss_step(model)
    assert _all_gathers(wrapper, lambda: _loss_step(wrapper)) == \
        _all_gathers(plain, lambda: _loss_step(plain))
