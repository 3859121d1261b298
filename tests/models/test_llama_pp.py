"""The Llama example meets the pipeline protocol: pp=2 (1F1B, and
Interleaved1F1B with 2 stages per rank) and pp=2 x tp=2 (either built-in
plan) train like one process, with accumulation 2 and active clipping; its
default split points work."""
import copy

import pytest
import torch

from tests.lm_toy import make_token_batches
from tests.parallelize import tp_cases
from tests.parallelize.pipeline_cases import num_tp_params, stage_state
from tests.toy import assert_states_close


def _llama(num_layers=2):
    from mmpar.models.llama import Llama
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, num_layers=num_layers, num_heads=4,
                 num_kv_heads=2, max_seq_len=16)


def _batches():
    return make_token_batches(num=tp_cases.STEPS * tp_cases.ACCUMULATE,
                              batch_size=4, seq_len=16, vocab_size=64)


def _pipelined(parallel, num_layers):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    topology = setup_parallelism(parallel, None)  # reset by the harness
    model = parallelize(_llama(num_layers), topology, parallel, None)
    norms = tp_cases._train(model.train_step,
                            tp_cases.optim_wrapper_for(model), _batches())
    return stage_state(model), norms, num_tp_params(model)


def _reference(num_layers):
    model = copy.deepcopy(_llama(num_layers))
    norms = tp_cases._train(model.train_step,
                            tp_cases.optim_wrapper_for(model), _batches())
    return {k: v.detach().clone()
            for k, v in model.state_dict().items()}, norms


def _check(results, num_layers):
    state = {}
    for part, _, _ in results:
        state.update(part)
    expected, expected_norms = _reference(num_layers)
    assert_states_close(state, expected, atol=1e-6, rtol=1e-5)
    for _, norms, _ in results:  # the clip's norm covers every stage
        assert norms == pytest.approx(expected_norms, rel=1e-5)


@pytest.mark.parametrize('schedule,num_layers,stages_per_rank', [
    ('1F1B', 2, 1), ('Interleaved1F1B', 4, 2)])
def test_llama_pp2_matches_one_process(run_dist, schedule, num_layers,
                                       stages_per_rank):
    from mmpar.models.llama import pipeline_split_points
    points = pipeline_split_points(num_layers, 2 * stages_per_rank)
    parallel = dict(pp=2, pipeline=dict(
        schedule=schedule, num_microbatches=2, split_points=points,
        stages_per_rank=stages_per_rank))
    results = run_dist(_pipelined, parallel, num_layers)
    assert all(num_tp == 0 for _, _, num_tp in results)
    _check(results, num_layers)


@pytest.mark.parametrize('plan', ['llama', 'llama_no_sp'])
def test_llama_pp2_x_tp2_matches_one_process(run_dist, plan):
    # 'llama' is sequence-parallel: a stage hands its pp peer at the same
    # tp rank that rank's sequence shard, a plain (2, 8, 32) tensor of a
    # (2, 16, 32) micro-batch (measured).
    from mmpar.models.llama import pipeline_split_points
    parallel = dict(pp=2, tp=2, tp_plan=plan, pipeline=dict(
        schedule='1F1B', num_microbatches=2,
        split_points=pipeline_split_points(2, 2)))
    results = run_dist(_pipelined, parallel, 2, world_size=4)
    assert all(num_tp > 0 for _, _, num_tp in results)
    _check(results, 2)
