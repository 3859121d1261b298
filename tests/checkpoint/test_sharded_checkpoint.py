"""The ``sharded`` checkpoint format (torch.distributed.checkpoint
directories): config key, atomic directories, exact resume under DDP and
both FSDP wrappers, resume on another world size, conversion to a full file.
Runners run inside the shared gloo pools (no torchrun start-up per run); the
2-rank runs each test resumes from are the session's shared ones
(``trained_run``, tests/trained.py), read through torch's own DCP reader."""
import os
import re
import shutil

import pytest
import torch
from mmengine.config import Config

from mmpar.checkpoint.format import check_checkpoint_format
from mmpar.checkpoint.latest import (find_latest_complete_checkpoint,
                                     is_complete_checkpoint)
from mmpar.checkpoint.sharded import PLAIN_FILE, merge, split_tensors
from tests.e2e import (DEFAULT_CONFIG, ROOT, assert_same_training_state,
                       load_ckpt, read_dcp_checkpoint, run_tool)
from tests.trained import CONFIGS, SHARED_EPOCHS, checkpoint_path
from tests.trained import plain_model as _plain_model
from tests.trained import small_cfg as _small_cfg
from tests.trained import train_dist as _train_dist


def _convert(src, dst):
    run_tool(['python', 'tools/convert_checkpoint.py', src, dst])
    return load_ckpt(dst)


# ---------------------------------------------------------------- units


def test_checkpoint_format_is_validated():
    assert check_checkpoint_format('sharded') == 'sharded'
    with pytest.raises(ValueError, match=r"checkpoint_format='dcp'.*"
                       r"'full', 'sharded'"):
        check_checkpoint_format('dcp')


def test_runner_rejects_bad_format_before_any_work(tmp_path):
    from mmpar.runner import Runner
    cfg = _small_cfg(CONFIGS['MMDistributedDataParallel'], tmp_path, 1,
                     'bad_format', fmt='Sharded')
    cfg.launcher = 'none'
    with pytest.raises(ValueError, match='checkpoint_format'):
        Runner.from_cfg(cfg)
    assert not os.listdir(tmp_path)


def test_split_and_merge_round_trip():
    state = dict(state=dict(w=dict(step=torch.tensor(3.), exp_avg=torch.ones(
        2), note='x')), param_groups=[dict(lr=0.1, params=['w'])], empty={})
    tensors, rest = split_tensors(state)
    assert set(tensors) == {'state'} and set(tensors['state']['w']) == {
        'step', 'exp_avg'}
    assert rest == dict(state=dict(w=dict(note='x')),
                        param_groups=state['param_groups'], empty={})
    merged = merge(tensors, rest)
    assert merged.keys() == state.keys()
    assert merged['state']['w']['exp_avg'] is state['state']['w']['exp_avg']
    assert merged['state']['w']['note'] == 'x' and merged['empty'] == {}


def test_incomplete_directories_are_not_resumed_from(tmp_path):
    first = tmp_path / 'epoch_1'
    first.mkdir()
    (first / '.metadata').write_bytes(b'x')
    torch.save(dict(meta=dict(epoch=1)), first / PLAIN_FILE)
    assert is_complete_checkpoint(str(first))
    # An interrupted save: a '.tmp' directory, and one without DCP's index.
    (tmp_path / 'epoch_3.tmp').mkdir()
    (tmp_path / 'epoch_3.tmp' / '.metadata').write_bytes(b'x')
    torch.save({}, tmp_path / 'epoch_3.tmp' / PLAIN_FILE)
    second = tmp_path / 'epoch_2'
    second.mkdir()
    torch.save({}, second / PLAIN_FILE)
    (tmp_path / 'last_checkpoint').write_text(str(second))
    assert not is_complete_checkpoint(str(second))
    assert find_latest_complete_checkpoint(str(tmp_path)) == str(first)


@pytest.fixture(scope='module')
def one_process_runner(tmp_path_factory):
    """A one-process Runner trained 1 epoch, saved sharded as epoch_1."""
    from mmpar.runner import Runner
    work_dir = tmp_path_factory.mktemp('one_process')
    cfg = _small_cfg(CONFIGS['MMDistributedDataParallel'], work_dir, 1,
                     'one_process')
    cfg.launcher = 'none'
    runner = Runner.from_cfg(cfg)
    runner.train()
    assert is_complete_checkpoint(str(work_dir / 'epoch_1'))
    return runner, work_dir / 'epoch_1'


def test_interrupted_sharded_save_leaves_previous_checkpoint(
        one_process_runner, tmp_path, monkeypatch):
    """A save that dies after DCP wrote its shards (here: while writing the
    plain-data file) leaves only ``epoch_2.tmp``; epoch_1 stays the newest
    complete checkpoint and a new save of the same name succeeds."""
    from mmpar.checkpoint import sharded
    runner, epoch_1 = one_process_runner
    shutil.copytree(epoch_1, tmp_path / 'epoch_1')

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sharded, 'atomic_save', killed)
    with pytest.raises(KeyboardInterrupt):
        runner.save_checkpoint(str(tmp_path), 'epoch_2')
    assert (tmp_path / 'epoch_2.tmp' / '.metadata').is_file()
    assert not (tmp_path / 'epoch_2').exists()
    assert find_latest_complete_checkpoint(str(tmp_path)) == str(
        tmp_path / 'epoch_1')
    monkeypatch.undo()
    runner.save_checkpoint(str(tmp_path), 'epoch_2')
    assert not (tmp_path / 'epoch_2.tmp').exists()
    assert is_complete_checkpoint(str(tmp_path / 'epoch_2'))


def test_weights_only_sharded_save_loads_into_model(one_process_runner,
                                                    tmp_path):
    runner, _ = one_process_runner
    runner.save_checkpoint(
        str(tmp_path), 'weights', save_optimizer=False,
        save_param_scheduler=False)
    expected = {k: v.clone() for k, v in runner.model.state_dict().items()}
    with torch.no_grad():
        for param in runner.model.parameters():
            param.zero_()
    checkpoint = runner.load_checkpoint(str(tmp_path / 'weights'))
    assert 'optimizer' not in checkpoint
    for key, value in runner.model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_corrupt_sharded_checkpoint_fails_naming_it(one_process_runner,
                                                    tmp_path):
    from mmpar.runner import CheckpointLoadError
    runner, epoch_1 = one_process_runner
    plain, shard, index = (tmp_path / name for name in ('a', 'b', 'c'))
    for copy in (plain, shard, index):
        shutil.copytree(epoch_1, copy)
    (plain / PLAIN_FILE).write_bytes((plain / PLAIN_FILE).read_bytes()[:99])
    with pytest.raises(CheckpointLoadError, match=PLAIN_FILE):
        runner.load_checkpoint(str(plain))
    distcp = next(shard.glob('*.distcp'))
    distcp.write_bytes(distcp.read_bytes()[:len(distcp.read_bytes()) // 2])
    with pytest.raises(CheckpointLoadError,
                       match=f"sharded checkpoint '{shard}'.*earlier"):
        runner.load_checkpoint(str(shard))
    (index / '.metadata').unlink()
    with pytest.raises(FileNotFoundError, match='not a complete sharded'):
        runner.load_checkpoint(str(index))


# --------------------------------------------- 2 ranks, every wrapper


@pytest.mark.parametrize('wrapper_type', list(CONFIGS))
def test_sharded_resume_is_exact(run_dist, trained_run, tmp_path,
                                 wrapper_type):
    """Resume from the straight run's epoch-2 directory to epoch 3: the
    straight run's epoch 3, bit for bit."""
    config = CONFIGS[wrapper_type]
    straight = trained_run(wrapper_type, 'sharded')
    # Directories, written atomically; last_checkpoint names the newest.
    for epoch in range(1, SHARED_EPOCHS + 1):
        names = os.listdir(straight / f'epoch_{epoch}')
        assert sorted(names) == sorted(
            ['.metadata', PLAIN_FILE] +
            [n for n in names if n.endswith('.distcp')])
    assert not list(straight.glob('*.tmp'))
    assert not list(straight.glob('*.pth'))
    assert (straight / 'last_checkpoint').read_text().endswith(
        f'epoch_{SHARED_EPOCHS}')
    resumed = tmp_path / 'resumed'
    run_dist(_train_dist, config, resumed, 3, f'{wrapper_type}_s_resume',
             resume=True, load_from=str(straight / 'epoch_2'))
    # It resumed (a fresh start would have written epochs 1 and 2 here).
    assert sorted(p.name for p in resumed.glob('epoch_*')) == ['epoch_3']
    assert 'resumed epoch: 2' in ''.join(
        p.read_text() for p in resumed.glob('*/*.log'))

    a = read_dcp_checkpoint(resumed / 'epoch_3')
    b = read_dcp_checkpoint(straight / 'epoch_3')
    assert_same_training_state(a, b)
    assert a['meta']['epoch'] == 3


# ------------------------------------------- another world size on resume


class _CaptureLoaded:
    """A hook that records the optimizer state as resumed (before_train runs
    after load_or_resume), keyed by parameter names, full-sized."""

    priority = 'VERY_HIGH'

    def __init__(self):
        self.state = None

    def __getattr__(self, name):  # every other hook point: do nothing
        if name.startswith(('before_', 'after_')):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def before_train(self, runner):
        from mmpar.checkpoint import pipeline
        from mmpar.wrappers import describe
        self.epoch = runner.epoch
        info = describe(runner.model)
        if info.pipeline is not None:
            # A pipelined model: every stage's, gathered under plain names.
            full = pipeline.full_optim_state_dict(info.pipeline,
                                                  runner.optim_wrapper)
            self.state = full['state']
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_optimizer_state_dict)
        full = get_optimizer_state_dict(
            info.state_module, runner.optim_wrapper.optimizer,
            options=StateDictOptions(full_state_dict=True))
        self.state = {
            name: {k: v.clone() for k, v in value.items()}
            for name, value in full['state'].items()
        }


def _resume_and_capture(config, work_dir, ckpt, max_epochs, name, fmt,
                        **extra):
    """Resume from ``ckpt``, train to ``max_epochs``; the state as loaded."""
    from mmpar.runner import Runner
    cfg = _small_cfg(config, work_dir, max_epochs, name, fmt, resume=True,
                     load_from=str(ckpt), **extra)
    if int(os.environ.get('WORLD_SIZE', '1')) == 1:
        cfg.launcher = 'none'
    runner = Runner.from_cfg(cfg)
    hook = _CaptureLoaded()
    runner._hooks.insert(0, hook)
    runner.train()
    return hook.epoch, hook.state


def _named_saved_state(ckpt: dict, model) -> dict:
    """Optimizer state of a full checkpoint keyed by parameter names."""
    state = ckpt['optimizer']['state']
    if all(isinstance(k, str) for k in state):
        return state
    names = [name for name, _ in model.named_parameters()]
    return {names[index]: value for index, value in state.items()}


def _assert_resumed_state(loaded: dict, saved: dict) -> None:
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        for key in ('step', 'exp_avg', 'exp_avg_sq'):
            torch.testing.assert_close(
                loaded[name][key], value[key], atol=0, rtol=0)


# (wrapper, format): sharded under FSDP2 and DDP, full under FSDP1.
WORLD_SIZE_CASES = [('MMFullyShard', 'sharded'),
                    ('MMDistributedDataParallel', 'sharded'),
                    ('MMFullyShardedDataParallel', 'full')]


@pytest.mark.parametrize('wrapper_type,fmt', WORLD_SIZE_CASES)
def test_two_rank_checkpoint_resumes_on_four(run_dist, trained_run, tmp_path,
                                             wrapper_type, fmt):
    config = CONFIGS[wrapper_type]
    ckpt_path = checkpoint_path(trained_run(wrapper_type, fmt), 2, fmt)
    saved = read_dcp_checkpoint(ckpt_path) if fmt == 'sharded' \
        else load_ckpt(ckpt_path)
    saved_state = _named_saved_state(saved, _plain_model())

    four = tmp_path / 'four'
    results = run_dist(_resume_and_capture, config, four, ckpt_path, 3,
                       f'{wrapper_type}_{fmt}_w4', fmt, world_size=4)
    for epoch, loaded in results:
        assert epoch == 2
        _assert_resumed_state(loaded, saved_state)
    # Training went on from there: 1,437 images / (4 x 256) = 2 steps.
    after = read_dcp_checkpoint(four / 'epoch_3') if fmt == 'sharded' \
        else load_ckpt(four / 'epoch_3.pth')
    after_state = _named_saved_state(after, _plain_model())
    for name, value in saved_state.items():
        assert after_state[name]['step'].item() == value['step'].item() + 2
    assert after['meta']['iter'] == saved['meta']['iter'] + 2


def test_two_rank_sharded_checkpoint_resumes_on_one_process_and_converts(
        trained_run, tmp_path):
    config = CONFIGS['MMFullyShard']
    ckpt = trained_run('MMFullyShard', 'sharded') / 'epoch_2'
    saved = read_dcp_checkpoint(ckpt)
    epoch, loaded = _resume_and_capture(config, tmp_path / 'one', ckpt, 3,
                                        'fsdp2_to_one_single', 'sharded')
    assert epoch == 2
    _assert_resumed_state(loaded, saved['optimizer']['state'])
    # One process: ceil(1,437 / 256) = 6 steps in epoch 3, saved sharded.
    after = read_dcp_checkpoint(tmp_path / 'one' / 'epoch_3')
    for name, value in saved['optimizer']['state'].items():
        assert after['optimizer']['state'][name]['step'].item() == \
            value['step'].item() + 6

    # tools/convert_checkpoint.py: one full file, plain-model keys in order,
    # loads strictly into a plain model and resumes on one process.
    converted = _convert(ckpt, tmp_path / 'converted.pth')
    model = _plain_model()
    assert list(converted['state_dict']) == list(model.state_dict())
    model.load_state_dict(converted['state_dict'], strict=True)
    # What torch's own reader finds in the directory, tensor for tensor.
    assert_same_training_state(converted, saved)
    epoch, loaded = _resume_and_capture(config, tmp_path / 'from_full',
                                        tmp_path / 'converted.pth', 3,
                                        'converted_single', 'full')
    assert epoch == 2
    _assert_resumed_state(loaded, saved['optimizer']['state'])


# ------------------------- iteration-based, every wrapper, both formats


def _train_iters(wrapper, work_dir, max_iters, name, fmt, **extra):
    from mmpar.runner import Runner
    cfg = _small_cfg('configs/vit_digits/vit_digits_iter.py', work_dir, 1,
                     name, fmt, **extra)
    del cfg.train_cfg['max_epochs']
    cfg.train_cfg.max_iters = max_iters
    cfg.train_cfg.val_interval = 100  # no validation: not what is tested
    cfg.default_hooks.checkpoint.interval = 3
    cfg.model_wrapper_cfg = Config.fromfile(
        str(ROOT / CONFIGS[wrapper])).get('model_wrapper_cfg')
    Runner.from_cfg(cfg).train()


@pytest.mark.parametrize('wrapper,fmt', [('MMDistributedDataParallel', 'full'),
                                         ('MMFullyShardedDataParallel', 'full'),
                                         ('MMFullyShard', 'sharded')])
def test_iter_based_resume_is_exact(run_dist, tmp_path, wrapper, fmt):
    """6 iterations straight (a checkpoint at 3); resumed from its
    iteration-3 checkpoint to 6: the same state."""
    resumed, straight = tmp_path / 'resumed', tmp_path / 'straight'
    tag = f'{wrapper}_{fmt}'
    run_dist(_train_iters, wrapper, straight, 6, f'{tag}_6', fmt)
    suffix = '' if fmt == 'sharded' else '.pth'
    assert (straight / 'last_checkpoint').read_text().endswith(
        f'iter_6{suffix}')
    run_dist(_train_iters, wrapper, resumed, 6, f'{tag}_resume', fmt,
             resume=True, load_from=str(straight / f'iter_3{suffix}'))
    assert not (resumed / f'iter_3{suffix}').exists()  # not trained again
    load = read_dcp_checkpoint if fmt == 'sharded' else load_ckpt
    a = load(str(resumed / f'iter_6{suffix}'))
    assert a['meta']['iter'] == 6
    assert_same_training_state(a, load(str(straight / f'iter_6{suffix}')))
    # Resumed at iteration 3, not replayed from the start.
    logs = ''.join(p.read_text() for p in resumed.glob('*/*.log'))
    assert 'resumed epoch: 0, iter: 3' in logs


# ----------------------------------------- the command-line tools, once


def test_dist_train_sharded_then_test_on_one_process(tmp_path):
    run_tool([
        'bash', 'tools/dist_train.sh', CONFIGS['MMFullyShard'], 2,
        '--work-dir', tmp_path, '--cfg-options', 'train_cfg.max_epochs=2',
        'checkpoint_format=sharded', 'default_hooks.checkpoint.max_keep_ckpts=1'
    ])
    # max_keep_ckpts removed the older directory.
    assert sorted(p.name for p in tmp_path.glob('epoch_*')) == ['epoch_2']
    assert (tmp_path / 'last_checkpoint').read_text().endswith('epoch_2')
    proc = run_tool([
        'python', 'tools/test.py', DEFAULT_CONFIG, tmp_path / 'epoch_2',
        '--work-dir', tmp_path / 'test'
    ])
    out = proc.stdout + proc.stderr
    assert 'Load sharded checkpoint' in out
    accuracy = float(re.search(r'accuracy/top1: ([\d.]+)', out).group(1))
    assert accuracy > 15  # trained weights, not the random start (~10%)
