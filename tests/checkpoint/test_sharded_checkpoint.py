"""The ``sharded`` checkpoint format (torch.distributed.checkpoint
directories): config key, atomic directories, exact resume under DDP and
both FSDP wrappers, resume on another world size, conversion to a full file.
Runners run inside the shared gloo pools (no torchrun start-up per run)."""
import os
import re
import shutil

import pytest
import torch
from mmengine.config import Config

from mmpar.models import DigitsViT
from mmpar.checkpoint.format import check_checkpoint_format
from mmpar.checkpoint.latest import (find_latest_complete_checkpoint,
                                     is_complete_checkpoint)
from mmpar.checkpoint.sharded import (PLAIN_FILE, merge, sharded_to_full,
                                      split_tensors)
from tests.e2e import (DEFAULT_CONFIG, ROOT, assert_same_training_state,
                       load_ckpt, run_tool)

CONFIGS = {
    'MMDistributedDataParallel': 'configs/vit_digits/vit_digits.py',
    'MMFullyShardedDataParallel': 'configs/vit_digits/vit_digits_fsdp.py',
    'MMFullyShard': 'configs/vit_digits/vit_digits_fsdp2.py',
}
# Small enough for seconds per epoch on 2 CPU ranks: 3 iterations per epoch
# at 2 ranks (1,437 images / (2 x 256)).
SMALL_MODEL = dict(embed_dim=16, depth=2, num_heads=2)
BATCH = 256


def _small_cfg(config, work_dir, max_epochs, name, fmt='sharded', **extra):
    cfg = Config.fromfile(str(ROOT / config))
    cfg.model.update(SMALL_MODEL)
    cfg.train_dataloader.batch_size = BATCH
    cfg.val_dataloader.batch_size = 180
    cfg.train_cfg.max_epochs = max_epochs
    cfg.default_hooks.logger.interval = 1
    cfg.launcher = 'pytorch'
    cfg.work_dir = str(work_dir)
    cfg.checkpoint_format = fmt
    cfg.experiment_name = name  # unique: MMEngine keeps loggers by name
    cfg.update(extra)
    return cfg


def _train(config, work_dir, max_epochs, name, fmt='sharded', **extra):
    """Train (or resume) in this process; returns the optimizer's steps."""
    from mmpar.runner import Runner
    cfg = _small_cfg(config, work_dir, max_epochs, name, fmt, **extra)
    runner = Runner.from_cfg(cfg)
    runner.train()
    return runner


def _train_dist(config, work_dir, max_epochs, name, fmt='sharded', **extra):
    _train(config, work_dir, max_epochs, name, fmt, **extra)


def _plain_model():
    return DigitsViT(image_size=8, patch_size=2, mlp_ratio=2.0,
                     **SMALL_MODEL)


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
def test_sharded_resume_is_exact(run_dist, tmp_path, wrapper_type):
    config = CONFIGS[wrapper_type]
    resumed, straight = tmp_path / 'resumed', tmp_path / 'straight'
    run_dist(_train_dist, config, resumed, 2, f'{wrapper_type}_s2')
    # Directories, written atomically; last_checkpoint names the newest.
    assert sorted(os.listdir(resumed / 'epoch_2')) == sorted(
        ['.metadata', PLAIN_FILE] +
        [n for n in os.listdir(resumed / 'epoch_2') if n.endswith('.distcp')])
    assert not list(resumed.glob('*.tmp')) and not list(resumed.glob('*.pth'))
    assert (resumed / 'last_checkpoint').read_text().endswith('epoch_2')
    saved_at = (resumed / 'epoch_2' / '.metadata').stat().st_mtime_ns
    run_dist(_train_dist, config, resumed, 3, f'{wrapper_type}_s_resume',
             resume=True)
    # It resumed (a fresh start would have rewritten epoch_2).
    assert (resumed / 'epoch_2' / '.metadata').stat().st_mtime_ns == saved_at
    run_dist(_train_dist, config, straight, 3, f'{wrapper_type}_s3')

    a = sharded_to_full(str(resumed / 'epoch_3'))
    b = sharded_to_full(str(straight / 'epoch_3'))
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
def test_two_rank_checkpoint_resumes_on_four(run_dist, tmp_path, wrapper_type,
                                             fmt):
    config = CONFIGS[wrapper_type]
    saved_dir = tmp_path / 'two'
    run_dist(_train_dist, config, saved_dir, 2, f'{wrapper_type}_{fmt}_w2',
             fmt)
    if fmt == 'sharded':
        ckpt_path = saved_dir / 'epoch_2'
        saved = sharded_to_full(str(ckpt_path))
    else:
        ckpt_path = saved_dir / 'epoch_2.pth'
        saved = load_ckpt(ckpt_path)
    saved_state = _named_saved_state(saved, _plain_model())

    four = tmp_path / 'four'
    results = run_dist(_resume_and_capture, config, four, ckpt_path, 3,
                       f'{wrapper_type}_{fmt}_w4', fmt, world_size=4)
    for epoch, loaded in results:
        assert epoch == 2
        _assert_resumed_state(loaded, saved_state)
    # Training went on from there: 1,437 images / (4 x 256) = 2 steps.
    after = sharded_to_full(str(four / 'epoch_3')) if fmt == 'sharded' \
        else load_ckpt(four / 'epoch_3.pth')
    after_state = _named_saved_state(after, _plain_model())
    for name, value in saved_state.items():
        assert after_state[name]['step'].item() == value['step'].item() + 2
    assert after['meta']['iter'] == saved['meta']['iter'] + 2


def test_two_rank_sharded_checkpoint_resumes_on_one_process_and_converts(
        run_dist, tmp_path):
    config = CONFIGS['MMFullyShard']
    run_dist(_train_dist, config, tmp_path / 'two', 2, 'fsdp2_to_one', 'sharded')
    ckpt = tmp_path / 'two' / 'epoch_2'
    saved = sharded_to_full(str(ckpt))
    epoch, loaded = _resume_and_capture(config, tmp_path / 'one', ckpt, 3,
                                        'fsdp2_to_one_single', 'sharded')
    assert epoch == 2
    _assert_resumed_state(loaded, saved['optimizer']['state'])
    # One process: ceil(1,437 / 256) = 6 steps in epoch 3, saved sharded.
    after = sharded_to_full(str(tmp_path / 'one' / 'epoch_3'))
    for name, value in saved['optimizer']['state'].items():
        assert after['optimizer']['state'][name]['step'].item() == \
            value['step'].item() + 6

    # tools/convert_checkpoint.py: one full file, plain-model keys in order,
    # loads strictly into a plain model and resumes on one process.
    converted = _convert(ckpt, tmp_path / 'converted.pth')
    model = _plain_model()
    assert list(converted['state_dict']) == list(model.state_dict())
    model.load_state_dict(converted['state_dict'], strict=True)
    torch.testing.assert_close(model.head.weight,
                               saved['state_dict']['head.weight'])
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
    resumed, straight = tmp_path / 'resumed', tmp_path / 'straight'
    tag = f'{wrapper}_{fmt}'
    run_dist(_train_iters, wrapper, resumed, 3, f'{tag}_3', fmt)
    suffix = '' if fmt == 'sharded' else '.pth'
    assert (resumed / 'last_checkpoint').read_text().endswith(
        f'iter_3{suffix}')
    run_dist(_train_iters, wrapper, resumed, 6, f'{tag}_resume', fmt,
             resume=True)
    run_dist(_train_iters, wrapper, straight, 6, f'{tag}_6', fmt)
    load = sharded_to_full if fmt == 'sharded' else load_ckpt
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
