"""BatchNorm buffers under every data-parallel wrapper (DDP, FSDP1, FSDP2,
naive, bucketed): ``buffer_sync`` makes them equal over the data axis before
evaluation and before checkpoints. (DDP broadcasts rank 0's buffers before
each training forward only, so after the last one the ranks differ too.)"""
import pytest
import torch
import torch.distributed as dist
from mmengine.config import Config

from mmpar.wrappers.builder import build_model_wrapper
from tests.e2e import ROOT, load_ckpt, read_dcp_checkpoint
from tests.toy import make_optim_wrapper

WRAPPERS = ('MMDistributedDataParallel', 'MMFullyShardedDataParallel',
            'MMFullyShard',
            'MMNaiveDataParallel', 'MMBucketDataParallel')


def _bn_model():
    from tests.data.bn_digits import BNDigitsNet
    torch.manual_seed(0)
    return BNDigitsNet(width=4)


def _rank_batch(rank):
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return dict(inputs=torch.randn(8, 1, 8, 8, generator=gen) * (rank + 1),
                data_samples=torch.randint(0, 10, (8, ), generator=gen))


def _stats(model):
    return {k: v.detach().clone() for k, v in model.named_buffers()
            if 'running' in k}


def _gather(stats):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, stats)
    return out


def _buffers_after_train_then_val(wrapper_type, mode):
    """Per wrapper and mode: (before sync, after val_step) on every rank."""
    wrapper_cfg = dict(type=wrapper_type)
    if mode != 'default':
        wrapper_cfg['buffer_sync'] = mode
    model = build_model_wrapper(wrapper_cfg, _bn_model())
    model.train()
    optim_wrapper = make_optim_wrapper(model, lr=0.01)
    model.train_step(_rank_batch(dist.get_rank()), optim_wrapper)
    before = _gather(_stats(model.module))
    model.eval()
    model.val_step(_rank_batch(0))
    after = _gather(_stats(model.module))
    return before, after


def _all_modes():
    return {(w, m): _buffers_after_train_then_val(w, m)
            for w in WRAPPERS for m in ('default', 'broadcast', 'average',
                                        None)}


def test_buffer_sync_modes_for_every_wrapper(run_dist):
    results = run_dist(_all_modes)[0]
    for (wrapper, mode), (before, after) in results.items():
        key = next(iter(before[0]))
        # Each rank normalised its own data: the statistics differ.
        assert not torch.equal(before[0][key], before[1][key]), wrapper
        for name in before[0]:
            if mode in ('default', 'broadcast'):
                expected = before[0][name]  # data rank 0's, as DDP
            elif mode == 'average':
                expected = (before[0][name] + before[1][name]) / 2
            else:  # None: left alone
                torch.testing.assert_close(after[1][name], before[1][name])
                continue
            for rank in (0, 1):
                torch.testing.assert_close(
                    after[rank][name], expected,
                    msg=f'{wrapper} {mode} {name} rank {rank}')


def test_bad_buffer_sync_is_refused_naming_the_key():
    from mmpar.wrappers.builder import check_wrapper_cfg
    with pytest.raises(ValueError,
                       match="buffer_sync='rank0'.*'broadcast', 'average'"):
        check_wrapper_cfg(dict(type='MMFullyShard', buffer_sync='rank0'))


# -- Runner: full and sharded checkpoints of one run evaluate the same -----
def _cfg(wrapper_type, checkpoint_format, work_dir):
    cfg = Config.fromfile(str(ROOT / 'configs/vit_digits/vit_digits.py'))
    cfg.custom_imports = dict(imports=['tests.data.bn_digits'],
                              allow_failed_imports=False)
    cfg.model = dict(type='BNDigitsNet', width=4)
    cfg.model_wrapper_cfg = dict(type=wrapper_type)
    cfg.checkpoint_format = checkpoint_format
    cfg.train_dataloader.batch_size = 128
    cfg.val_dataloader.batch_size = 90
    cfg.test_dataloader = cfg.val_dataloader
    cfg.train_cfg.max_epochs = 1
    cfg.param_scheduler = None
    cfg.launcher = 'pytorch'
    cfg.work_dir = work_dir
    cfg.experiment_name = f'bn_{wrapper_type}_{checkpoint_format}'
    return cfg


def _train_and_test(wrapper_type, checkpoint_format, work_dir):
    from mmpar.runner import Runner
    cfg = _cfg(wrapper_type, checkpoint_format, work_dir)
    runner = Runner.from_cfg(cfg)
    runner.train()
    val = runner.val_loop.run()
    ckpt = f'{work_dir}/epoch_1' + ('.pth' if checkpoint_format == 'full'
                                    else '')
    test_cfg = _cfg(wrapper_type, checkpoint_format, work_dir + '_test')
    test_cfg.load_from = ckpt
    test_cfg.experiment_name += '_test'
    test = Runner.from_cfg(test_cfg).test()
    return val, test


@pytest.mark.parametrize(
    'wrapper_type',
    ['MMDistributedDataParallel', 'MMFullyShardedDataParallel', 'MMFullyShard'])
def test_full_and_sharded_checkpoints_evaluate_alike(run_dist, tmp_path,
                                                     wrapper_type):
    full_val, full_test = run_dist(_train_and_test, wrapper_type, 'full',
                                   str(tmp_path / 'full'))[0]
    sharded_val, sharded_test = run_dist(_train_and_test, wrapper_type,
                                         'sharded',
                                         str(tmp_path / 'sharded'))[0]
    # The same run (same seeds), so the in-training validation agrees, and
    # each checkpoint evaluates to what validation saw.
    assert full_val == sharded_val
    assert full_test == full_val
    assert sharded_test == full_val
    full = load_ckpt(tmp_path / 'full' / 'epoch_1.pth')['state_dict']
    sharded = read_dcp_checkpoint(tmp_path / 'sharded' / 'epoch_1')
    running = [k for k in full if 'running' in k]
    assert running
    # The same statistics in both formats: DCP spreads replicated tensors
    # over the ranks, so unsynced buffers would come from different ranks.
    for key in running:
        torch.testing.assert_close(sharded['state_dict'][key], full[key],
                                   rtol=0, atol=0, msg=key)
