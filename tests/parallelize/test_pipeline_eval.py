"""Val/test under pp (and pp x tp): a forward-only pass through the stages
gives the one-process predictions (the evaluator counts the last pp rank's);
the shipped DigitsViT meets the protocol and trains at parity."""
import pytest
import torch

from mmpar.models.vit import DigitsViT
from tests.parallelize.pipeline_cases import num_tp_params, stage_state
from tests.toy import assert_states_close, make_optim_wrapper


def _vit():
    torch.manual_seed(0)
    return DigitsViT(embed_dim=16, depth=4, num_heads=2)


def _batches(n, batch_size):
    gen = torch.Generator().manual_seed(3)
    return [dict(inputs=torch.randn(batch_size, 1, 8, 8, generator=gen),
                 data_samples=torch.randint(0, 10, (batch_size, ),
                                            generator=gen))
            for _ in range(n)]


def _pipelined_vit(schedule, train_batches, val_batch, tp=1):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    extra = dict(split_points=['blocks.2']) if schedule == '1F1B' else \
        dict(stages_per_rank=2)
    parallel = dict(pp=2, pipeline=dict(schedule=schedule,
                                         num_microbatches=4, **extra))
    if tp > 1:  # the MLPs split Megatron-style (DigitsViT's TP_PLAN)
        parallel.update(tp=tp, tp_plan='digits_vit')
    topology = setup_parallelism(parallel, None)
    model = parallelize(_vit(), topology, parallel, None)
    optim_wrapper = make_optim_wrapper(model, accumulative_counts=2,
                                       clip=0.05)
    for batch in train_batches:
        model.train_step(batch, optim_wrapper)
    with torch.no_grad():
        preds = model.val_step(val_batch)
    assert (num_tp_params(model) > 0) == (tp > 1)
    return preds, stage_state(model)


@pytest.mark.parametrize('schedule,tp', [('1F1B', 1),
                                         ('InterleavedZeroBubble', 1),
                                         ('1F1B', 2)])
def test_val_predictions_equal_one_process(run_dist, schedule, tp):
    # A train batch of 7 and a val batch of 6 do not divide into 4
    # micro-batches: padded, the padding left out.
    train, val = _batches(2, 8) + _batches(1, 7), _batches(1, 6)[0]
    results = run_dist(_pipelined_vit, schedule, train, val, tp=tp,
                       world_size=2 * tp)
    reference = _vit()
    optim_wrapper = make_optim_wrapper(reference, accumulative_counts=2,
                                       clip=0.05)
    for batch in train:
        reference.train_step(batch, optim_wrapper)
    state = {k: v for _, s in results for k, v in s.items()}
    assert_states_close(state, reference.state_dict(), 1e-6, 1e-5)
    with torch.no_grad():
        expected = reference.val_step(val)
    # Every rank returns them; mmpar.runner.data_axis counts the last pp
    # rank's.
    for preds, _ in results:
        assert [int(p['pred_label']) for p in preds] == \
            [int(p['pred_label']) for p in expected]
        assert [int(p['gt_label']) for p in preds] == \
            val['data_samples'].tolist()
