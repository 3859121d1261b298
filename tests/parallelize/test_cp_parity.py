"""Context parallelism trains like one process on the same global batch:
cp=2 on 2 gloo ranks (DDP over the cp group; FSDP1; with activation
checkpointing); cp=2 x FSDP2 (dp_shard=2), cp=2 x HSDP (dp_replicate=2),
cp=2 x tp=2 (sequence-parallel norms) and cp=2 x pp=2 on 4; with
accumulation 2, active global-norm clipping and targets masked unevenly
over ranks, chunks and micro-batches (the loss is normalised by the
window's global token count). The logged loss of each micro-batch is the
one-process one."""
import pytest

from tests.parallelize.cp_cases import (make_lm_batches, make_llama,
                                        reference, train_cp)
from tests.toy import assert_states_close

# fp32 on CPU: chunks, shards and token sums change only summation order.
ATOL, RTOL = 1e-6, 1e-5
PIPELINE = dict(schedule='1F1B', num_microbatches=2,
                split_points=['layers.1'])
LAYOUTS = {
    'cp2': (2, dict(cp=2), None),
    # Checkpointed blocks run their key/value all-gather again in backward.
    'cp2_ac': (2, dict(cp=2), dict(type='MMDistributedDataParallel',
                                   activation_checkpointing='LlamaBlock')),
    'dp2_no_cp': (2, dict(dp_shard=2), None),
    'cp2_fsdp1': (2, dict(cp=2), dict(
        type='MMFullyShardedDataParallel',
        fsdp_auto_wrap_policy=dict(type='module_class',
                                   module_classes=['LlamaBlock']))),
    'cp2_fsdp2_dp2': (4, dict(cp=2, dp_shard=2), dict(type='MMFullyShard')),
    # HSDP: FSDP2 shards over cp, replicates over dp_replicate (2-D mesh).
    'cp2_hsdp': (4, dict(cp=2, dp_replicate=2), dict(type='MMFullyShard')),
    'cp2_tp2': (4, dict(cp=2, tp=2, tp_plan='llama'), None),
    'cp2_pp2': (4, dict(cp=2, pp=2, pipeline=PIPELINE), None),
}


def _check(run_dist, name, masked=True):
    world_size, parallel, wrapper_cfg = LAYOUTS[name]
    batches = make_lm_batches(masked=masked)
    results = run_dist(train_cp, parallel, wrapper_cfg, batches,
                       world_size=world_size)
    expected, expected_losses, expected_norms = reference(make_llama(),
                                                          batches)
    covered = set()
    for part, losses, norms, _ in results:
        # Every rank's weights (a pipeline rank's: its stages').
        assert_states_close(part, {k: expected[k] for k in part}, ATOL,
                            RTOL)
        covered |= set(part)
        # Clipping hides a uniform scale of the gradient; its norm does not.
        assert norms == pytest.approx(expected_norms, rel=1e-5)
        assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    assert covered == set(expected)
    return [coords for *_, coords in results]


@pytest.mark.parametrize('masked', [True, False], ids=['masked', 'full'])
def test_cp2_matches_one_process(run_dist, masked):
    assert _check(run_dist, 'cp2', masked) == [(0, 0), (0, 1)]


def test_cp2_with_activation_checkpointing(run_dist):
    assert _check(run_dist, 'cp2_ac') == [(0, 0), (0, 1)]


def test_cp2_with_fsdp1(run_dist):
    assert _check(run_dist, 'cp2_fsdp1') == [(0, 0), (0, 1)]


def test_dp2_masked_matches_one_process(run_dist):
    # No cp: ranks still count different tokens; the global count makes
    # the gradient the one-process one.
    assert _check(run_dist, 'dp2_no_cp') == [(0, 0), (1, 0)]


@pytest.mark.parametrize('name', ['cp2_fsdp2_dp2', 'cp2_hsdp', 'cp2_tp2',
                                  'cp2_pp2'])
def test_cp2_composes_on_4_ranks(run_dist, name):
    coords = _check(run_dist, name)
    assert sorted(set(coords)) == {
        'cp2_fsdp2_dp2': [(0, 0), (0, 1), (1, 0), (1, 1)],
        'cp2_hsdp': [(0, 0), (0, 1), (1, 0), (1, 1)],
        'cp2_tp2': [(0, 0), (0, 1)],
        'cp2_pp2': [(0, 0), (0, 1)]}[name]
