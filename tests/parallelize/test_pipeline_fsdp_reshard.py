"""FSDP2 pipeline stages reshard and reduce-scatter after every micro-batch
(``parallel.pipeline.reshard_per_microbatch``, default True), and still
match one process: pp=2 x dp_shard=2 on 4 ranks, each layer its own FSDP2
unit, gradient accumulation 2, active global-norm clipping, 4 steps.

torch 2.13's stage keeps the stage gathered and its gradients unsharded
until one reduction after the last micro-batch (``False``, and the
zero-bubble schedules whatever the key says)."""
import pytest

from tests.parallelize.pipeline_cases import (make_pipe_model, reference,
                                              train_recording_fsdp_backwards)
from tests.toy import assert_states_close, make_batches

ATOL, RTOL = 1e-6, 1e-5  # as tests/parallelize/test_pipeline_parity.py
OPTIM = dict(lr=0.1, accumulative_counts=2, clip=0.05)
NUM_BATCHES, NUM_MICROBATCHES = 4, 2
# Every layer (an nn.Sequential) its own unit besides the stage's root.
FSDP2 = dict(type='MMFullyShard', fsdp_auto_wrap_policy=dict(
    type='module_class', module_classes=['Sequential']))
FOUR_STAGES = dict(split_points=['layers.1', 'layers.2', 'layers.3'],
                   stages_per_rank=2)


def _train(run_dist, schedule, **pipeline):
    parallel = dict(pp=2, pipeline=dict(
        schedule=schedule, num_microbatches=NUM_MICROBATCHES, **pipeline))
    batches = make_batches(num_batches=NUM_BATCHES, batch_size=8)
    results = run_dist(train_recording_fsdp_backwards, parallel, FSDP2,
                       batches, OPTIM, world_size=4)
    # Parity: the data rank 0 stages make up the model.
    expected, _ = reference(make_pipe_model(), batches, **OPTIM)
    state = {}
    for part, _, dp_rank, _, _, _ in results:
        if dp_rank == 0:
            state.update(part)
    assert_states_close(state, expected, ATOL, RTOL)
    return [(r[4], r[5]) for r in results]


@pytest.mark.parametrize('schedule,pipeline', [
    ('1F1B', {}),
    ('Interleaved1F1B', FOUR_STAGES),
])
def test_each_microbatch_reshards_and_reduce_scatters(run_dist, schedule,
                                                      pipeline):
    for backwards, reductions in _train(run_dist, schedule, **pipeline):
        stages = {s for s, _, _, _ in backwards}
        # Every micro-batch of every step ran a whole backward here.
        assert len(backwards) == len(stages) * NUM_BATCHES * \
            NUM_MICROBATCHES
        # The first stage's root (the embedding) and its layers are units.
        assert max(units for _, _, _, units in backwards) >= 2
        for stage, sharded, reduce_scatters, units in backwards:
            # Right after its backward: every unit reduced its gradients
            # (one reduce-scatter each) and gave its gathered parameters
            # back.
            assert sharded, (stage, backwards)
            assert reduce_scatters == units, (stage, backwards)
        # torch's reduction after the last micro-batch finds nothing left.
        assert [n for _, n in reductions] == [0] * len(stages) * NUM_BATCHES


@pytest.mark.parametrize('schedule,pipeline', [
    ('1F1B', dict(reshard_per_microbatch=False)),
    # The zero-bubble schedules keep torch's behaviour whatever the key.
    ('InterleavedZeroBubble', dict(stages_per_rank=2)),
])
def test_torchs_behaviour_reduces_once_after_the_last(run_dist, schedule,
                                                      pipeline):
    for backwards, reductions in _train(run_dist, schedule, **pipeline):
        units = {s: n for s, _, _, n in backwards}
        for stage, sharded, reduce_scatters, _ in backwards:
            assert not sharded and reduce_scatters == 0, (stage, backwards)
        assert sorted(reductions) == sorted(
            (stage, n) for stage, n in units.items()
            for _ in range(NUM_BATCHES))
