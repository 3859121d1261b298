"""An ep=2 checkpoint resumes: at ep=2 bit for bit, and at ep=1 (one
process) and ep=4 (4 ranks) as the ep=2 run continued, within the
tolerance of sums in another order. One ep=2 run of 4 iterations (the MoE
Llama, routing forced to balance) saves at 2 and 4; each resume starts
from its iteration-2 full checkpoint, whose experts are saved whole and
resharded on load (one expert per rank at ep=4).

The same in the sharded (DCP) format: a second ep=2 run saves sharded
directories, and the resumes at ep=1 and ep=4 read its iteration-2 one,
DCP resharding the experts (saved as ep=2's DTensor shards) on load.

The continued steps at ep=1 are also the forced-balance parity of ep=2
with one process (tests/tools/test_ep_end_to_end.py has natural routing).
"""
import pytest
import torch

from tests.configs.test_llama_configs import SHRINK
from tests.e2e import (assert_same_training_state, load_ckpt,
                       read_dcp_checkpoint, run_tool)
from tests.tools.ep_logs import assert_close_moments, logged

CONFIG = 'configs/llama_shakespeare/llama_shakespeare_moe.py'
EP_CONFIG = 'configs/llama_shakespeare/llama_shakespeare_moe_ep.py'
OPTIONS = [f'{k}={v}' for k, v in SHRINK.items()
           if k != 'train_dataloader.batch_size'] + [
    'model.moe.hidden_dim=32', 'model.moe.force_balanced=True',
    'train_cfg.max_iters=4', 'train_cfg.val_interval=100',
    'default_hooks.checkpoint.interval=2',
    # a clip that bites: the norm must be the global one to match
    'optim_wrapper.clip_grad.max_norm=0.5']
GLOBAL_BATCH = 8
# checkpoint_format -> (its iteration-2 and 4 checkpoints, their reader)
FORMATS = {'full': ('iter_2.pth', 'iter_4.pth', load_ckpt),
           'sharded': ('iter_2', 'iter_4', read_dcp_checkpoint)}


def _train(work_dir, ranks, resume=None, checkpoint_format='full'):
    options = [*OPTIONS, f'checkpoint_format={checkpoint_format}',
               f'train_dataloader.batch_size={GLOBAL_BATCH // ranks}']
    if ranks == 1:
        args = ['python', 'tools/train.py', CONFIG]
    else:
        args = ['bash', 'tools/dist_train.sh', EP_CONFIG, ranks]
        options.append(f'parallel.ep={ranks}')
    if resume is not None:
        args += ['--resume', resume]
    proc = run_tool([*args, '--work-dir', work_dir, '--cfg-options',
                     *options])
    return proc.stdout + proc.stderr


@pytest.fixture(scope='module')
def ep2_run(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('ep2')
    return work_dir, _train(work_dir, 2)


@pytest.fixture(scope='module')
def ep2_sharded_run(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('ep2_sharded')
    return work_dir, _train(work_dir, 2, checkpoint_format='sharded')


def test_resumed_at_ep2_bit_exact(ep2_run, tmp_path):
    work_dir, log = ep2_run
    resumed = _train(tmp_path, 2, resume=work_dir / 'iter_2.pth')
    assert 'resumed epoch: 0, iter: 2' in resumed
    assert logged(resumed, 'loss') == logged(log, 'loss')[2:]
    assert_same_training_state(load_ckpt(tmp_path / 'iter_4.pth'),
                               load_ckpt(work_dir / 'iter_4.pth'))


@pytest.mark.parametrize('checkpoint_format', ['full', 'sharded'])
@pytest.mark.parametrize('ep', [1, 4])
def test_resumed_at_another_ep_matches_the_continued_run(
        request, tmp_path, ep, checkpoint_format):
    work_dir, log = request.getfixturevalue(
        'ep2_run' if checkpoint_format == 'full' else 'ep2_sharded_run')
    at_2, at_4, read = FORMATS[checkpoint_format]
    resumed = _train(tmp_path, ep, resume=work_dir / at_2,
                     checkpoint_format=checkpoint_format)
    assert 'resumed epoch: 0, iter: 2' in resumed
    for key in ('loss', 'grad_norm', 'moe_aux_loss'):
        # Logged with 4 decimals; the experts' rows in other blocks.
        assert logged(resumed, key) == pytest.approx(
            logged(log, key)[2:], abs=2e-4), key
    got, want = read(tmp_path / at_4), read(work_dir / at_4)
    assert got['meta']['iter'] == want['meta']['iter'] == 4
    assert got['state_dict'].keys() == want['state_dict'].keys()
    for key, value in want['state_dict'].items():
        torch.testing.assert_close(got['state_dict'][key], value, atol=1e-5,
                                   rtol=1e-4, msg=key)
    assert_close_moments(got, want)
