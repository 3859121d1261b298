"""Tensor parallelism through the real launcher, as a user runs it.

``bash tools/dist_train.sh CFG 2`` with ``parallel=dict(tp=2,
tp_plan=...)``: it trains, saves, resumes bit-exactly, its checkpoint loads
strictly into the plain model, ``tools/test.py`` evaluates it with the
accuracy the run's own (tp=2) validation reported, and a bad plan is refused
before training.
"""
import re

from mmpar.models.vit import DigitsViT
from tests.e2e import assert_same_training_state, load_ckpt, run_tool

CONFIG = 'configs/vit_digits/vit_digits_iter.py'
TP = ['parallel.tp=2', 'parallel.tp_plan=digits_vit']
SHORT = ['train_cfg.val_interval=8', 'default_hooks.checkpoint.interval=4']


def _train(work_dir, iters, *extra):
    return run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2, '--work-dir',
                     work_dir, *extra, '--cfg-options', *TP,
                     f'train_cfg.max_iters={iters}', *SHORT])


def _last_accuracy(output: str) -> float:
    return float(re.findall(r'accuracy/top1: ([\d.]+)', output)[-1])


def test_dist_train_tp2_resumes_bit_exactly_and_loads_into_plain_model(
        tmp_path):
    # The straight run writes the iteration-4 checkpoint the resumed run
    # starts from (in its own work dir).
    straight = _train(tmp_path / 'straight', 8)
    resumed = _train(tmp_path / 'resumed', 8, '--resume',
                     tmp_path / 'straight' / 'iter_4.pth')
    log = resumed.stdout + resumed.stderr
    assert 'resumed epoch: 0, iter: 4' in log
    assert not (tmp_path / 'resumed' / 'iter_4.pth').exists()
    final = load_ckpt(tmp_path / 'straight' / 'iter_8.pth')
    assert_same_training_state(
        load_ckpt(tmp_path / 'resumed' / 'iter_8.pth'), final)
    # Gathered: the plain model's keys and shapes, loadable strictly.
    plain = DigitsViT(embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0)
    plain.load_state_dict(final['state_dict'], strict=True)
    assert {k: v.shape for k, v in final['state_dict'].items()} == {
        k: v.shape for k, v in plain.state_dict().items()}
    # tools/test.py on the TP checkpoint, on one process (unsplit), agrees
    # with the validation the tp=2 run did on the same weights.
    one = run_tool(['python', 'tools/test.py', CONFIG,
                    tmp_path / 'straight' / 'iter_8.pth'])
    assert _last_accuracy(one.stdout + one.stderr) == \
        _last_accuracy(straight.stdout + straight.stderr)


def test_dist_train_refuses_a_plan_matching_nothing(tmp_path):
    proc = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2, '--work-dir',
                     tmp_path, '--cfg-options', 'parallel.tp=2',
                     'parallel.tp_plan.type=module_plan',
                     'parallel.tp_plan.plan.blocks*ffn=colwise'],
                    timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "pattern 'blocks*ffn' matches no module" in output, output[-3000:]
    assert 'blocks.0.mlp.0' in output  # the model's module names, listed
    assert 'Iter(train)' not in output
    assert not list(tmp_path.glob('*.pth'))



def _one_node(work_dir):
    """The same run on one node of 4 gloo processes (the shared pool): the
    config and options the launches below get, through the Runner."""
    import argparse

    from mmengine.config import Config, DictAction

    from mmpar.runner import Runner
    from tests.e2e import ROOT
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    options = parser.parse_args(
        ['--cfg-options', *TP, 'train_cfg.max_iters=4', *SHORT]).cfg_options
    cfg = Config.fromfile(str(ROOT / CONFIG))
    cfg.merge_from_dict(options)
    cfg.launcher = 'pytorch'
    cfg.work_dir = str(work_dir)
    cfg.experiment_name = 'tp2_one_node'
    Runner.from_cfg(cfg).train()


def test_two_nodes_keep_each_tp_group_on_one_node(run_dist, tmp_path):
    """NNODES=2 loopback nodes of 2 processes, tp=2 x dp=2: every tp group
    lies inside one node (from the ranks' node and local ranks), and the run
    ends with the same weights as one node of 4 processes (the shared gloo
    pool of 4: no fourth torchrun start-up)."""
    import json

    from tests.e2e import ROOT, run_nodes
    config = tmp_path / 'placement.py'
    config.write_text('\n'.join([
        f"_base_ = '{ROOT / CONFIG}'",
        "custom_imports = dict(imports=['tests.parallelize.placement_hook'], "
        'allow_failed_imports=False)',
        "custom_hooks = [dict(type='RecordPlacement')]",
    ]) + '\n')
    options = ['--cfg-options', *TP, 'train_cfg.max_iters=4', *SHORT]
    one_node = tmp_path / 'one_node'
    run_dist(_one_node, one_node, world_size=4)
    run_nodes(lambda n: ['bash', 'tools/dist_train.sh', config, '2',
                         '--work-dir', tmp_path / f'node{n}', *options])
    records = [
        json.loads(path.read_text())
        for n in (0, 1) for path in (tmp_path / f'node{n}').glob(
            'placement_rank*.json')
    ]
    assert sorted(r['rank'] for r in records) == [0, 1, 2, 3]
    node_of = {r['rank']: r['node'] for r in records}
    for record in records:
        assert record['node'] == record['rank'] // 2
        assert record['local_rank'] == record['rank'] % 2
        assert {node_of[r] for r in record['tp_ranks']} == {record['node']}
    assert_same_training_state(
        load_ckpt(tmp_path / 'node0' / 'iter_4.pth'),
        load_ckpt(one_node / 'iter_4.pth'))
