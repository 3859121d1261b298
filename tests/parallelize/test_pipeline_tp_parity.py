"""Pipeline x tensor parallelism matches one process: pp=2 x tp=2 on 4 ranks
(1F1B and the virtual-stage Interleaved1F1B), and pp=2 x tp=2 x dp=2 on 8
(FSDP2 and the tensor-parallel DDP), with gradient accumulation 2, active
global-norm clipping and 4 steps; validation (forward only) at pp=2 x tp=2
gives the one-process outputs. The model is PipeMLP with a colwise ->
rowwise pair per layer and a split head, its plan plain ``module_plan`` data.
"""
import copy

import pytest
import torch

from tests.parallelize.pipeline_cases import (PIPE_TP_PLAN, build_pipelined,
                                              make_pipe_model, reference,
                                              train_pipelined)
from tests.toy import assert_states_close, make_batches, make_optim_wrapper

# fp32 on CPU: micro-batches and tp shards change only the summation order.
ATOL, RTOL = 1e-6, 1e-5
CLIP = 0.05  # far below the gradient norm here: clipping is active
OPTIM = dict(lr=0.1, accumulative_counts=2, clip=CLIP)
EXPAND = 2  # layers are Linear(16, 32), Tanh, Linear(32, 16)
SCHEDULES = {
    '1F1B': dict(split_points=['layers.2']),
    'Interleaved1F1B': dict(split_points=['layers.1', 'layers.2',
                                          'layers.3'], stages_per_rank=2),
}


def _run(run_dist, schedule, wrapper_cfg, world_size, num_microbatches):
    pipeline = dict(schedule=schedule, num_microbatches=num_microbatches,
                    **SCHEDULES[schedule])
    parallel = dict(pp=2, tp=2, tp_plan=PIPE_TP_PLAN, pipeline=pipeline)
    batches = make_batches(num_batches=4, batch_size=8)
    results = run_dist(train_pipelined, parallel, wrapper_cfg, batches,
                       OPTIM, expand=EXPAND, world_size=world_size)
    expected, expected_losses = reference(make_pipe_model(expand=EXPAND),
                                          batches, **OPTIM)
    state = {}
    for part, losses, dp_rank, num_tp in results:
        assert num_tp > 0  # every stage's layers are split over tp
        if dp_rank == 0:
            state.update(part)
            if world_size == 4:  # one data rank: it logs the global loss
                assert losses == pytest.approx(expected_losses, rel=1e-5,
                                               abs=1e-6)
    # Gathered (full_tensor) weights, plain names, every stage.
    assert_states_close(state, expected, ATOL, RTOL)
    return results


@pytest.mark.parametrize('schedule', list(SCHEDULES))
def test_pp2_x_tp2_matches_one_process(run_dist, schedule):
    results = _run(run_dist, schedule, None, 4, num_microbatches=4)
    assert [r[2] for r in results] == [0, 0, 0, 0]


@pytest.mark.parametrize('wrapper', [
    'MMFullyShard',
    # Becomes MMTensorParallelDDP (tp > 1): local shards all-reduced over
    # the data axis once per optimizer step, its backward hooks removed.
    'MMDistributedDataParallel',
])
def test_pp2_x_tp2_x_dp2_matches_one_process(run_dist, wrapper):
    # 3-D: each data rank reads half of the global batch of 8.
    results = _run(run_dist, '1F1B', dict(type=wrapper), 8,
                   num_microbatches=2)
    assert sorted(r[2] for r in results) == [0] * 4 + [1] * 4


def _train_then_predict(parallel, batches, val_batch):
    model, _ = build_pipelined(parallel, None, expand=EXPAND)
    optim_wrapper = make_optim_wrapper(model, **OPTIM)
    for batch in batches:
        model.train_step(batch, optim_wrapper)
    with torch.no_grad():
        return model.val_step(val_batch)


def test_pp2_x_tp2_validation_matches_one_process(run_dist):
    # A val batch of 6 does not divide into 4 micro-batches: padded, the
    # padding left out.
    batches = make_batches(num_batches=2, batch_size=8)
    val = make_batches(num_batches=1, batch_size=6, seed=5)[0]
    parallel = dict(pp=2, tp=2, tp_plan=PIPE_TP_PLAN, pipeline=dict(
        schedule='1F1B', num_microbatches=4, **SCHEDULES['1F1B']))
    results = run_dist(_train_then_predict, parallel, batches, val,
                       world_size=4)
    model = copy.deepcopy(make_pipe_model(expand=EXPAND))
    optim_wrapper = make_optim_wrapper(model, **OPTIM)
    for batch in batches:
        model.train_step(batch, optim_wrapper)
    with torch.no_grad():
        expected = model.val_step(val)
    for preds in results:  # every rank returns the last stage's
        assert len(preds) == len(expected) == 6
        for pred, ref in zip(preds, expected):
            torch.testing.assert_close(pred['pred'], ref['pred'], atol=ATOL,
                                       rtol=RTOL)
            torch.testing.assert_close(pred['target'], ref['target'])
