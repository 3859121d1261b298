"""Pipeline parallelism matches one process: every schedule at pp=2 on 2
ranks, and pp=2 x dp=2 (DDP, FSDP2) on 4, with gradient accumulation 2,
active global-norm clipping and 4 steps."""
import pytest

from tests.parallelize.pipeline_cases import (make_pipe_model, reference,
                                              train_pipelined)
from tests.toy import assert_states_close, make_batches

# fp32 on CPU: micro-batches change only the summation order.
ATOL, RTOL = 1e-6, 1e-5
CLIP = 0.05  # far below the gradient norm here: clipping is active
OPTIM = dict(lr=0.1, accumulative_counts=2, clip=CLIP)
SCHEDULES = {
    'GPipe': dict(split_points=['layers.2']),
    '1F1B': dict(split_points=['layers.2']),
    'Interleaved1F1B': dict(split_points=['layers.1', 'layers.2',
                                          'layers.3'], stages_per_rank=2),
    'LoopedBFS': dict(split_points=['layers.1', 'layers.2', 'layers.3'],
                      stages_per_rank=2),
    'InterleavedZeroBubble': dict(stages_per_rank=2),
    'ZBVZeroBubble': dict(stages_per_rank=2),
}


def _merge(results):
    state, losses = {}, {}
    for part, rank_losses, dp_rank, num_tp in results:
        assert num_tp == 0
        # The logged loss is the same on every stage of a data rank.
        assert losses.setdefault(dp_rank, rank_losses) == rank_losses
        if dp_rank == 0:
            state.update(part)
    return state, losses


def _check(results, batches):
    expected, expected_losses = reference(make_pipe_model(), batches,
                                          **OPTIM)
    state, losses = _merge(results)
    assert_states_close(state, expected, ATOL, RTOL)
    if len(losses) == 1:  # with dp > 1 each data rank logs its own shard's
        assert losses[0] == pytest.approx(expected_losses, rel=1e-5,
                                          abs=1e-6)


@pytest.mark.parametrize('schedule', list(SCHEDULES))
def test_each_schedule_matches_one_process_at_pp2(run_dist, schedule):
    pipeline = dict(schedule=schedule, num_microbatches=4,
                    **SCHEDULES[schedule])
    parallel = dict(pp=2, pipeline=pipeline)
    batches = make_batches(num_batches=4, batch_size=8)
    results = run_dist(train_pipelined, parallel, None, batches, OPTIM,
                       world_size=2)
    _check(results, batches)


@pytest.mark.parametrize('wrapper,schedule', [
    ('MMDistributedDataParallel', '1F1B'),
    # DDP with several stages per rank fails or is silently wrong when torch
    # drives DDP's reducer; mmpar all-reduces the stage's gradients itself.
    ('MMDistributedDataParallel', 'Interleaved1F1B'),
    ('MMFullyShard', '1F1B'),
    ('MMFullyShard', 'Interleaved1F1B'),
])
def test_pp2_x_dp2_matches_one_process(run_dist, wrapper, schedule):
    # Each data rank reads half of the global batch of 8: 2 micro-batches.
    pipeline = dict(schedule=schedule, num_microbatches=2,
                    **SCHEDULES[schedule])
    parallel = dict(pp=2, pipeline=pipeline)
    batches = make_batches(num_batches=4, batch_size=8)
    results = run_dist(train_pipelined, parallel, dict(type=wrapper),
                       batches, OPTIM, world_size=4)
    assert sorted(r[2] for r in results) == [0, 0, 1, 1]
    _check(results, batches)
