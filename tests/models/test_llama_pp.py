"""The Llama example meets the pipeline protocol: pp=2 (1F1B, and
Interleaved1F1B with 2 stages per rank) trains like one process, with
accumulation 2 and active clipping; its default split points work."""
import copy

import pytest
import torch

from tests.lm_toy import make_token_batches
from tests.parallelize import tp_cases
from tests.parallelize.pipeline_cases import stage_state
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
    return stage_state(model), norms


def _reference(num_layers):
    model = copy.deepcopy(_llama(num_layers))
    norms = tp_cases._train(model.train_step,
                            tp_cases.optim_wrapper_for(model), _batches())
    return {k: v.detach().clone()
            for k, v in model.state_dict().items()}, norms


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
    state = {}
    for part, _ in results:
        state.update(part)
    expected, expected_norms = _reference(num_layers)
    assert_states_close(state, expected, atol=1e-6, rtol=1e-5)
    for _, norms in results:  # the clip's norm covers every stage
        assert norms == pytest.approx(expected_norms, rel=1e-5)
