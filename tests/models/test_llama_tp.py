"""The Llama example's built-in tensor-parallel plans train like one process
(tp=2 on 2 ranks, tp=2 x DDP dp=2 on 4): accumulation 2, active clipping,
SGD (see tests/parallelize/tp_cases.py for why not AdamW)."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.lm_toy import make_token_batches
from tests.parallelize import tp_cases


def _llama():
    from mmpar.models.llama import Llama
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=16)


def _train(step, optim_wrapper, batches) -> list:
    # tp_cases' loop, on token batches.
    return tp_cases._train(step, optim_wrapper, batches)


def _llama_parity(plan: str):
    from mmpar.parallelize.tensor import apply_tp
    from mmpar.wrappers import MMTensorParallelDDP
    mesh = tp_cases.world_mesh(2)
    model = _llama()
    initial = tp_cases.full_state(model)
    batches = make_token_batches(num=tp_cases.STEPS * tp_cases.ACCUMULATE,
                                 batch_size=4, seq_len=16, vocab_size=64)
    reference = copy.deepcopy(model)
    ref_norms = _train(reference.train_step,
                       tp_cases.optim_wrapper_for(reference), batches)
    expected = ({k: v.detach().clone()
                 for k, v in reference.state_dict().items()}, ref_norms)

    apply_tp(model, mesh['tp'], plan)
    assert any(isinstance(p, DTensor) for p in model.parameters())
    wrapper = MMTensorParallelDDP(model,
                                  process_group=mesh['dp'].get_group())
    dp_rank, dp = mesh['dp'].get_local_rank(), mesh['dp'].size()
    norms = _train(wrapper.train_step, tp_cases.optim_wrapper_for(model),
                   [tp_cases.dp_slice(b, dp_rank, dp) for b in batches])
    actual = (dict(wrapper.full_state_dict()), norms)
    tp_cases.assert_parity(actual, expected, initial)
    _llama().load_state_dict(actual[0], strict=True)
    return dist.get_rank()


@pytest.mark.parametrize('plan', ['llama', 'llama_no_sp'])
def test_llama_tp2_parity(run_dist, plan):
    assert run_dist(_llama_parity, plan) == [0, 1]


def test_llama_tp2_explicit_prepare_input_parity(run_dist):
    """prepare_input written out: per-argument layouts with None for the
    rotary tables, and an MLP handed plain tensors (use_local_output)."""
    plan = tp_cases.explicit_llama_plan()
    assert run_dist(_llama_parity, plan) == [0, 1]


def test_llama_tp2_x_ddp_dp2_parity(run_dist):
    assert run_dist(_llama_parity, 'llama', world_size=4) == [0, 1, 2, 3]
