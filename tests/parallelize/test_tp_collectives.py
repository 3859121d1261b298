"""Tensor-parallel plans issue the Megatron-LM number of collectives.

Per transformer block and pass: 2 all-reduces of the activations (one per
attention, one per MLP), or with sequence parallelism 2 all-gathers and 2
reduce-scatters. ``prepare_input`` is what gets there: the block input is
laid out once for q/k/v (gate/up), and their input gradients add up before
one reduction. Counted per module by torch's ``CommDebugMode`` in one
process on the ``fake`` backend (world size 2, no communication): cheap
enough to guard every plan that ships.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from mmpar.parallelize.tensor import apply_tp
from tests.lm_toy import make_token_batches
from tests.parallelize import tp_cases

AG = 'all_gather_into_tensor'
RS = 'reduce_scatter_tensor'
AR = 'all_reduce'
SP_BLOCK = {AG: 2, RS: 2}  # per block and pass, with sequence parallelism
BLOCK = {AR: 2}  # per block and pass, without
# CommDebugMode's module tracker registers full backward hooks.
pytestmark = pytest.mark.filterwarnings(
    'ignore:For backward hooks to be called',
    'ignore:Full backward hook is firing')


@pytest.fixture
def tp_mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)
    return init_device_mesh('cpu', (2, ))


def _llama(num_layers=2):
    from mmpar.models.llama import Llama
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, num_layers=num_layers, num_heads=4,
                 num_kv_heads=2, max_seq_len=16)


def collectives(model, tp_mesh, plan, batch) -> dict:
    """``{module path: {'forward'|'backward': {collective: count}}}`` of one
    forward and backward of ``model`` split by ``plan``; the root's entry
    under ``''``."""
    apply_tp(model, tp_mesh, plan)
    mode = CommDebugMode()
    with mode:
        model(**batch, mode='loss')['loss'].backward()
    root = type(model).__name__
    counts = {}
    for path, passes in mode.comm_module_counts.items():
        if path == root or path.startswith(root + '.'):
            counts[path[len(root) + 1:]] = {
                side: {op.__name__: n for op, n in passes[side].items() if n}
                for side in ('forward', 'backward')}
    return counts


def _per_block(counts: dict, blocks) -> list:
    return [(counts[b]['forward'], counts[b]['backward']) for b in blocks]


def test_llama_sp_plan_gathers_once_per_block_input(tp_mesh):
    batch = make_token_batches(num=1, batch_size=4, seq_len=16)[0]
    counts = collectives(_llama(), tp_mesh, 'llama', batch)
    assert _per_block(counts, ['layers.0', 'layers.1']) == [
        (SP_BLOCK, SP_BLOCK)] * 2
    for part in ('attn', 'mlp'):  # one of each per sub-block and pass
        assert counts[f'layers.0.{part}']['forward'] == {AG: 1, RS: 1}
        assert counts[f'layers.0.{part}']['backward'] == {AG: 1, RS: 1}
    # The ends: the embedding's reduce-scatter (all-gather in backward),
    # the head's input all-gather (reduce-scatter) and its gathered logits.
    assert counts['']['forward'] == {AG: 2 * 2 + 2, RS: 2 * 2 + 1}
    assert counts['']['backward'] == {AG: 2 * 2 + 1, RS: 2 * 2 + 1}


def test_llama_no_sp_plan_all_reduces_once_per_block_input(tp_mesh):
    batch = make_token_batches(num=1, batch_size=4, seq_len=16)[0]
    counts = collectives(_llama(), tp_mesh, 'llama_no_sp', batch)
    assert _per_block(counts, ['layers.0', 'layers.1']) == [
        (BLOCK, BLOCK)] * 2


def test_per_projection_plan_is_what_prepare_input_saves(tp_mesh):
    """Without prepare_input each of q/k/v and gate/up gathers the block
    input itself: the count these tests guard against."""
    batch = make_token_batches(num=1, batch_size=4, seq_len=16)[0]
    counts = collectives(_llama(), tp_mesh,
                         dict(type='module_plan',
                              plan=tp_cases.llama_plan_without_prepare()),
                         batch)
    assert counts['layers.0']['forward'] == {AG: 5, RS: 2}
    assert counts['layers.0']['backward'] == {AG: 2, RS: 5}


def test_explicit_prepare_input_layouts(tp_mesh):
    """The dict form: a layout per positional argument (None: the rotary
    tables left alone); ``use_local_output=True`` hands the MLP plain
    tensors, so gate and up each all-reduce their input gradient (correct,
    more traffic; tests/models/test_llama_tp.py checks the numbers)."""
    batch = make_token_batches(num=1, batch_size=4, seq_len=16)[0]
    counts = collectives(_llama(), tp_mesh, tp_cases.explicit_llama_plan(),
                         batch)
    assert counts['layers.0.attn']['backward'] == {AG: 1, RS: 1}
    assert counts['layers.0.mlp']['forward'] == {AG: 1, RS: 1}
    assert counts['layers.0.mlp']['backward'] == {AG: 1, AR: 2}


def test_user_vit_plan_all_reduces_once_per_sub_block(tp_mesh):
    from examples.my_pkg.tp_vit import TP_PLAN
    batch = tp_cases.make_image_batches(1)[0]
    counts = collectives(tp_cases.make_splittable_vit(), tp_mesh,
                         dict(type='module_plan', plan=TP_PLAN), batch)
    assert _per_block(counts, ['blocks.0', 'blocks.1']) == [
        (BLOCK, BLOCK)] * 2


@pytest.mark.parametrize('prepare_inputs,backward', [(True, 2), (False, 5)])
def test_hf_plan_prepares_block_inputs(tp_mesh, prepare_inputs, backward):
    pytest.importorskip('transformers')
    from tests.parallelize.test_hf_plan import HFCausalLM
    torch.manual_seed(0)
    batch = make_token_batches(num=1, batch_size=4, seq_len=16)[0]
    counts = collectives(HFCausalLM(), tp_mesh,
                         dict(type='hf', prepare_inputs=prepare_inputs),
                         batch)
    for layer in ('lm.model.layers.0', 'lm.model.layers.1'):
        assert counts[layer]['forward'] == {AR: 2}
        assert counts[layer]['backward'] == {AR: backward}

