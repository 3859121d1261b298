"""Expert parallelism through the real launcher, as a user runs it:
``bash tools/dist_train.sh llama_shakespeare_moe_ep.py 2`` (ep=2: each rank
holds 2 of the 4 experts of every layer, tokens sent to them with
all-to-alls, the rest FSDP2-sharded), and the same at ep=2 x dp_shard=2 on
4 ranks (each rank half of its 2 experts), trains as ``tools/train.py`` on
one process with the same global batch: the same logged losses and
gradient norms (the global-norm clip sees the experts' gradients on every
rank), the same final weights and Adam moments; likewise ep=2 x tp=2,
pp=2 x ep=2 and ep=2 x cp=2 on 4 ranks. Every run routes both ways: blocks
0 and 2 by their scores (softmax top-2, auxiliary loss), block 1 forced to
balance (``model.moe.force_balanced=[1]``). dp_replicate=2 x ep=2 runs
with 2 accumulated micro-batches. On 8 ranks, ep=2 x tp=2 x pp=2 and
ep=2 x tp=2 x cp=2 go through ``tools/dist_verify.sh`` (2 steps, every
module's output and gradient against one process).
"""
import pytest

from tests.configs.test_llama_configs import SHRINK
from tests.e2e import run_tool
from tests.tools.ep_logs import (assert_matches_one_process, logged,
                                 train_one_process)

CONFIG = 'configs/llama_shakespeare/llama_shakespeare_moe.py'
EP_CONFIG = 'configs/llama_shakespeare/llama_shakespeare_moe_ep.py'
OPTIONS = [f'{k}={v}' for k, v in SHRINK.items()] + [
    # Both routings in every run: blocks 0 and 2 route by their scores
    # (uneven loads, all-to-all splits of any size), block 1 is forced to
    # balance (every expert the same number of tokens).
    'model.num_layers=3', 'model.moe.force_balanced=[1]',
    'model.moe.hidden_dim=32', 'train_cfg.max_iters=3',
    'train_cfg.val_interval=100', 'default_hooks.checkpoint.interval=3',
    # a clip that bites: the norm must be the global one to match
    'optim_wrapper.clip_grad.max_norm=0.5']
BATCH = SHRINK['train_dataloader.batch_size']
# An expert weight (4 experts): saved whole at every ep.
WHOLE_EXPERTS = 'layers.0.mlp.experts.w1'


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
    """The one-process reference, with both layouts' global batch."""
    return train_one_process(CONFIG, tmp_path_factory.mktemp('one'),
                             OPTIONS, 2 * BATCH)


@pytest.mark.parametrize('ranks,data_ranks,extra,layout', [
    (2, 2, [], 'parallel = dict(ep=2)'),
    # the experts also sharded by FSDP2 over efsdp = dp_shard = 2
    (4, 4, ['parallel.dp_shard=2'], 'parallel = dict(dp_shard=2, ep=2)'),
    # HSDP (dp_replicate=2 x ep=2): launched with accumulation by
    # test_dist_train_dp_replicate2_ep2_accumulates_like_one_process
    # the Llama plan with sequence parallelism; each tp pair runs the MoE
    # layers whole (the experts split over ep, not over tp) on the same
    # samples, so 2 data ranks
    (4, 2, ['parallel.tp=2', 'parallel.tp_plan=llama'],
     "parallel = dict(ep=2, tp=2, tp_plan='llama')"),
], ids=['ep2', 'ep2_dp_shard2', 'ep2_tp2'])
def test_dist_train_ep2_matches_one_process(tmp_path, one_process, ranks,
                                            data_ranks, extra, layout):
    one_dir, one_log = one_process
    ep = run_tool(['bash', 'tools/dist_train.sh', EP_CONFIG, ranks,
                   '--work-dir', tmp_path / 'ep', '--cfg-options', *OPTIONS,
                   *extra,
                   f'train_dataloader.batch_size={2 * BATCH // data_ranks}'])
    ep_log = ep.stdout + ep.stderr
    assert layout in ep_log
    assert_matches_one_process(ep_log, tmp_path / 'ep', one_log, one_dir,
                               ('loss', 'grad_norm', 'moe_aux_loss'),
                               WHOLE_EXPERTS)


def _four_ranks_against_one(tmp_path, options, *layout,
                            keys=('loss', 'grad_norm'), data_ranks=2,
                            one=None):
    """The ep config at ``layout`` on 4 ranks (``data_ranks`` of them
    reading different samples) and the config on one process (the same
    global batch) match in the logged ``keys``, the weights and Adam's
    moments; returns both logs. ``one``: the one-process run's (work dir,
    log) when a shared one was trained with these ``options``."""
    ep = run_tool(['bash', 'tools/dist_train.sh', EP_CONFIG, 4,
                   '--work-dir', tmp_path / 'ep', '--cfg-options', *options,
                   *layout,
                   f'train_dataloader.batch_size={2 * BATCH // data_ranks}'])
    if one is None:
        one = train_one_process(CONFIG, tmp_path / 'one', options,
                                2 * BATCH)
    one_dir, one_log = one
    ep_log = ep.stdout + ep.stderr
    assert_matches_one_process(ep_log, tmp_path / 'ep', one_log, one_dir,
                               keys, WHOLE_EXPERTS)
    return ep_log, one_log


def test_dist_train_pp2_ep2_matches_one_process(tmp_path):
    """pp=2 x ep=2 on 4 ranks (1F1B, 2 micro-batches): each stage's
    experts split over its 2 ep ranks, dispatched per micro-batch. Without
    balancing (a stage runs no model forward to add the auxiliary loss)."""
    ep_log, _ = _four_ranks_against_one(
        tmp_path, [*OPTIONS, 'model.moe.balance=None'], 'parallel.pp=2',
        'parallel.pipeline.schedule=1F1B',
        'parallel.pipeline.num_microbatches=2')
    assert "ep=2, pipeline=dict(num_microbatches=2, schedule='1F1B'), " \
        'pp=2' in ep_log


@pytest.mark.parametrize('balance', ['bias', 'aux_loss'])
def test_dist_train_ep2_cp2_matches_one_process(tmp_path, one_process,
                                                balance):
    """ep=2 x cp=2 on 4 ranks: each rank routes its part of every sequence
    (the MoE layer is per token), the experts sharded over efsdp = cp = 2.
    Balanced by the bias, its loads summed over the data and cp ranks as
    one process counts them: the final ``expert_bias`` buffers match; or
    by the auxiliary loss (the config's), per whole sequence: each rank's
    counts and score sums summed over the cp ranks (the scores' gradients
    too), against the shared one-process run."""
    if balance == 'bias':
        options = [*OPTIONS, 'model.moe.balance=bias',
                   'model.moe.bias_update_rate=0.01']
        keys, one = ('loss', 'grad_norm'), None
    else:
        options = OPTIONS
        keys, one = ('loss', 'grad_norm', 'moe_aux_loss'), one_process
    ep_log, _ = _four_ranks_against_one(tmp_path, options, 'parallel.cp=2',
                                        keys=keys, one=one)
    assert 'parallel = dict(cp=2, ep=2)' in ep_log
    assert f"balance='{balance}'" in ep_log


def test_dist_train_dp_replicate2_ep2_accumulates_like_one_process(
        tmp_path):
    """dp_replicate=2 x ep=2 (HSDP: the experts replicated over
    dp_replicate = 2, their gradients all-reduced over it, the rest sharded
    over ep and replicated) with 2 accumulated micro-batches (steps at
    iterations 2 and 3): the first micro-batch's gradients stay unreduced
    (the experts' units too, whose replicate-only mesh torch divides
    before and after the all-reduce), the step's match one process's. The
    layout's only launch: its parity without accumulation is the same
    reduction at every step."""
    ep_log, one_log = _four_ranks_against_one(
        tmp_path, [*OPTIONS, 'optim_wrapper.accumulative_counts=2'],
        'parallel.dp_replicate=2', keys=('loss', 'moe_aux_loss'),
        data_ranks=4)
    assert 'parallel = dict(dp_replicate=2, ep=2)' in ep_log
    # Logged from the first step on: iterations 2 and 3.
    norms = logged(one_log, 'grad_norm')
    assert len(norms) == 2
    assert logged(ep_log, 'grad_norm') == pytest.approx(norms, abs=2e-4)


@pytest.mark.parametrize('third,extra', [
    ('pp', ['model.moe.balance=None', 'parallel.pipeline.schedule=1F1B',
            'parallel.pipeline.num_microbatches=2']),
    ('cp', []),  # balanced by the auxiliary loss, per whole sequence
], ids=['ep2_tp2_pp2', 'ep2_tp2_cp2'])
def test_dist_verify_ep2_tp2_with_a_third_axis_agrees_with_one_process(
        tmp_path, third, extra):
    """The triple compositions on 8 ranks, checked as cheaply as honestly
    possible: ``tools/dist_verify.sh`` trains 2 steps of a 2-block MoE Llama
    (dim 32, 4 experts; block 0 routes by its scores, block 1 is forced to
    balance) at ep=2 x tp=2 ('llama' plan) x pp=2 or cp=2 and on one
    process with the same global batch, and compares every module's output
    and every gradient at each step (relative 1e-5; measured ~3e-7)."""
    from mmengine.config import Config
    options = [f'{k}={v}' for k, v in SHRINK.items()] + [
        'model.moe.hidden_dim=32', 'model.moe.force_balanced=[1]',
        'optim_wrapper.clip_grad.max_norm=0.5',  # bites: norms ~1
        'train_dataloader.batch_size=2', 'parallel.tp=2',
        'parallel.tp_plan=llama', f'parallel.{third}=2', *extra]
    proc = run_tool(['bash', 'tools/dist_verify.sh', EP_CONFIG, 8,
                     '--steps', 2, '--rtol', '1e-5', '--work-dir', tmp_path,
                     '--cfg-options', *options], check=False)
    report = tmp_path / 'report.txt'  # where they first differ, if they do
    assert report.exists(), proc.stderr[-3000:]
    assert 'all 2 steps agree' in report.read_text(), report.read_text()
    assert proc.returncode == 0
    layout = Config.fromfile(tmp_path / 'layout' / EP_CONFIG.split('/')[-1])
    assert {k: layout.parallel[k] for k in ('ep', 'tp', third)} == dict(
        ep=2, tp=2, **{third: 2})
