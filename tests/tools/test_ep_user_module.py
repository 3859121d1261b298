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
from tests.e2e import ROOT, run_tool
from tests.tools.ep_logs import assert_matches_one_process, train_one_process

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
    _, one_log = train_one_process(tmp_path / 'user_moe.py',
                                   tmp_path / 'one', OPTIONS, 4 * RANK_BATCH)
    ep_log = ep.stdout + ep.stderr
    assert 'parallel = dict(dp_shard=2, ep=2)' in ep_log
    assert_matches_one_process(ep_log, tmp_path / 'ep', one_log,
                               tmp_path / 'one', ('loss', 'grad_norm'),
                               'moe.experts.up', clip_every_step=True)
