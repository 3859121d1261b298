"""A user's own MoE model meets the expert-parallel protocol and trains at
ep=2 x dp_shard=2 (4 ranks, through ``tools/dist_train.sh``) as
``tools/train.py`` trains it on one process with the same global batch:
the same logged losses and global gradient norms (the clip bites) and the
same final weights. The model lives in tests/models/user_moe.py, loaded
with ``custom_imports`` as a user's would be; nothing in it knows about
ranks but its experts' ``to_local``.

Each rank holds 2 of the 4 experts (ep) and half of each of those
(FSDP2 over efsdp = dp_shard = 2); the router, embedding and head are
sharded over all 4 data ranks.
"""
import pytest
import torch

from tests.e2e import ROOT, load_ckpt, run_tool
from tests.tools.ep_logs import assert_close_moments, logged

ONE_CONFIG = '\n'.join([
    f"_base_ = '{ROOT}/configs/llama_shakespeare/llama_shakespeare.py'",
    "custom_imports = dict(imports=['tests.models.user_moe'], "
    'allow_failed_imports=False)',
    "model = dict(_delete_=True, type='UserMoELM', dim=32, hidden=32, "
    'num_experts=4, top_k=2)',
    'param_scheduler = []',
    *[f'{k} = None' for k in ('val_dataloader', 'val_cfg', 'val_evaluator',
                              'test_dataloader', 'test_cfg',
                              'test_evaluator')],
]) + '\n'
EP_CONFIG = '\n'.join([
    "_base_ = './user_moe.py'",
    'parallel = dict(ep=2, dp_shard=2)',
    "model_wrapper_cfg = dict(type='MMFullyShard')",
]) + '\n'
RANK_BATCH = 2
OPTIONS = [
    'train_dataloader.dataset.context_length=32',
    'default_hooks.logger.interval=1', 'train_cfg.max_iters=3',
    'default_hooks.checkpoint.interval=3',
    # a clip that bites: the norm must be the global one to match
    'optim_wrapper.clip_grad.max_norm=0.5']


def test_user_moe_at_ep2_dp_shard2_matches_one_process(tmp_path):
    (tmp_path / 'user_moe.py').write_text(ONE_CONFIG)
    (tmp_path / 'user_moe_ep.py').write_text(EP_CONFIG)
    ep = run_tool(['bash', 'tools/dist_train.sh', tmp_path / 'user_moe_ep.py',
                   4, '--work-dir', tmp_path / 'ep', '--cfg-options',
                   *OPTIONS, f'train_dataloader.batch_size={RANK_BATCH}'])
    one = run_tool(['python', 'tools/train.py', tmp_path / 'user_moe.py',
                    '--work-dir', tmp_path / 'one', '--cfg-options',
                    *OPTIONS, f'train_dataloader.batch_size={4 * RANK_BATCH}'])
    ep_log, one_log = ep.stdout + ep.stderr, one.stdout + one.stderr
    assert 'parallel = dict(dp_shard=2, ep=2)' in ep_log
    for key in ('loss', 'grad_norm'):
        got, want = logged(ep_log, key), logged(one_log, key)
        assert len(got) == 3, key
        # Logged with 4 decimals; the experts see their rows in other
        # blocks on 4 ranks (sums in another order).
        assert got == pytest.approx(want, abs=2e-4), key
    assert min(logged(one_log, 'grad_norm')) > 0.5  # the clip bit
    got = load_ckpt(tmp_path / 'ep' / 'iter_3.pth')
    want = load_ckpt(tmp_path / 'one' / 'iter_3.pth')
    assert_close_moments(got, want)
    a, b = got['state_dict'], want['state_dict']
    assert a.keys() == b.keys()
    assert a['moe.experts.up'].shape[0] == 4  # saved whole
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4,
                                   msg=key)
