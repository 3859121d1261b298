"""NonFiniteLossHook: stop or skip, the same decision on every rank."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from mmengine.logging import MMLogger

from mmpar.runner import NonFiniteLossError, NonFiniteLossHook
from mmpar.wrappers import MMDistributedDataParallel
from tests.toy import (make_batches, make_model, make_optim_wrapper,
                       shard_batch, train_reference)

# With accumulative_counts=2, a NaN in batch 1 spoils the first window
# (batches 0 and 1): skipping it must leave the run where a run on batches
# 2..5 alone ends, bit for bit (the skipped window leaves no optimizer state).
NAN_BATCH, WINDOW = 1, 2
OPTIM = dict(accumulative_counts=WINDOW, clip=0.05)


def _batches_with_nan(nan_rank=None, world_size=1):
    batches = make_batches(num_batches=6, batch_size=8)
    targets = batches[NAN_BATCH]['targets']
    # Poison one sample of the shard that ``nan_rank`` trains on.
    row = 0 if nan_rank is None else nan_rank * len(targets) // world_size
    targets[row, 0] = float('nan')
    return batches


def _fake_runner(model, optim_wrapper):
    return SimpleNamespace(
        model=model,
        optim_wrapper=optim_wrapper,
        iter=0,
        epoch=0,
        logger=MMLogger.get_instance('mmpar_test_nonfinite'))


def _train(model, batches, hook, shard=lambda b: b):
    """Train through the hook as the Runner would; returns the state."""
    module = getattr(model, 'module', model)
    optim_wrapper = make_optim_wrapper(module, **OPTIM)
    runner = _fake_runner(model, optim_wrapper)
    hook.before_train(runner)
    try:
        for batch in batches:
            model.train_step(shard(batch), optim_wrapper)
            runner.iter += 1
    finally:
        hook.after_train(runner)
    assert 'step' not in vars(optim_wrapper), 'after_train must unpatch'
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _expected_after_skip():
    return train_reference(make_model(), make_batches(6, 8)[WINDOW:], **OPTIM)


def test_skip_single_process_matches_run_without_the_bad_window():
    hook = NonFiniteLossHook(action='skip')
    state = _train(make_model(), _batches_with_nan(), hook)
    assert hook.num_skipped == 1
    for key, value in _expected_after_skip().items():
        assert torch.equal(state[key], value), key


def test_stop_single_process_names_iteration_and_terms():
    with pytest.raises(NonFiniteLossError) as info:
        _train(make_model(), _batches_with_nan(), NonFiniteLossHook())
    message = str(info.value)
    assert f'iteration {NAN_BATCH + 1} (epoch 1)' in message
    assert 'rank(s) [0]' in message and 'loss=nan' in message


@pytest.mark.parametrize('max_skips', [1, 2])
def test_skip_gives_up_after_max_skips(max_skips):
    """``max_skips=N`` skips N steps in a row (docs/troubleshooting.md);
    the next non-finite loss stops the run."""
    batches = _batches_with_nan()
    batches[3]['targets'][0, 0] = float('inf')  # second window bad too
    batches[5]['targets'][0, 0] = float('nan')  # and the third
    hook = NonFiniteLossHook('skip', max_skips=max_skips)
    with pytest.raises(NonFiniteLossError,
                       match=f'{max_skips} steps in a row skipped already, '
                       f'max_skips={max_skips}'):
        _train(make_model(), batches, hook)
    assert hook.num_skipped == max_skips


@pytest.mark.parametrize('kwargs', [dict(action='retry'), dict(max_skips=0)])
def test_bad_arguments_name_key_and_allowed(kwargs):
    with pytest.raises(ValueError, match='NonFiniteLossHook'):
        NonFiniteLossHook(**kwargs)


def _train_on_ranks(action, sync_strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MMDistributedDataParallel(
        make_model(), sync_strategy=sync_strategy)
    hook = NonFiniteLossHook(action=action)
    try:
        # Only rank 1's shard of batch 1 holds a NaN.
        state = _train(model, _batches_with_nan(nan_rank=1, world_size=world),
                       hook, lambda b: shard_batch(b, rank, world))
    except NonFiniteLossError as err:
        return str(err)
    return state, hook.num_skipped


@pytest.mark.parametrize('sync_strategy', ['single_auto_sync', 'forced_sync'])
def test_skip_on_two_ranks_when_one_sees_nan(run_dist, sync_strategy):
    expected = _expected_after_skip()
    for state, num_skipped in run_dist(_train_on_ranks, 'skip',
                                       sync_strategy):
        assert num_skipped == 1
        # fp32 all-reduce of two half-batch means vs one big batch.
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, atol=1e-6,
                                       rtol=1e-5)


def test_stop_on_two_ranks_when_one_sees_nan(run_dist):
    messages = run_dist(_train_on_ranks, 'stop', 'single_auto_sync')
    for rank, message in enumerate(messages):
        assert isinstance(message, str), f'rank {rank} did not stop'
        assert 'iteration 2 (epoch 1) on rank(s) [1]' in message
    assert 'loss=nan' in messages[1] and 'loss=nan' not in messages[0]


NAN_MODEL = ("model = dict(type='FaultyViT', fault='nan', fault_rank=0, "
             'fault_at=3)')


@pytest.mark.parametrize('action', ['stop', 'skip'])
def test_hook_in_a_real_run_of_tools_train(action, tmp_path):
    """One process, unwrapped model, the loss NaN at iteration 3."""
    from tests.e2e import load_ckpt, run_tool
    from tests.test_no_hangs import write_config
    config = write_config(
        tmp_path / 'cfg.py', NAN_MODEL,
        f"custom_hooks = [dict(type='NonFiniteLossHook', action='{action}')]")
    proc = run_tool(['python', 'tools/train.py', config, '--work-dir',
                     tmp_path / 'work'], timeout=300, check=False)
    output = proc.stdout + proc.stderr
    if action == 'stop':
        assert proc.returncode == 1
        assert ('NonFiniteLossError: non-finite loss at iteration 3 (epoch 1)'
                ' on rank(s) [0]') in output, output[-3000:]
        assert 'loss=nan' in output
    else:
        assert proc.returncode == 0, output[-3000:]
        assert 'skipped the optimizer step at iteration 3 (epoch 1)' in output
        state = load_ckpt(tmp_path / 'work' / 'epoch_1.pth')['state_dict']
        assert all(torch.isfinite(v).all() for v in state.values())
