"""Muon through the real launcher, as a user runs it:
``bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_muon.py
2`` (FSDP2, each matrix orthogonalised whole on its owner rank) ends with the
weights ``tools/train.py`` reaches on one process on the same global batch,
and its sharded checkpoint holds both rules' state (Muon's momentum, AdamW's
moments)."""
from tests.configs.test_llama_configs import SHRINK
from tests.e2e import read_dcp_checkpoint, run_tool
from tests.optim.test_muon_layouts import RELATIVE_ERROR, relative_error

CONFIG = 'configs/llama_shakespeare/llama_shakespeare_muon.py'
OPTIONS = [f'{k}={v}' for k, v in SHRINK.items()] + [
    'train_cfg.max_iters=4', 'train_cfg.val_interval=4',
    'default_hooks.checkpoint.interval=4', 'custom_hooks=[]']


def test_dist_train_fsdp2_muon_matches_one_process(tmp_path):
    fsdp2 = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2, '--work-dir',
                      tmp_path / 'fsdp2', '--cfg-options', *OPTIONS])
    # The same global batch (2 x 4 windows) on one process.
    run_tool(['python', 'tools/train.py', CONFIG, '--work-dir',
              tmp_path / 'one', '--cfg-options', *OPTIONS,
              'train_dataloader.batch_size=8'])
    log = fsdp2.stdout + fsdp2.stderr
    assert "type='Muon'" in log and 'MMFullyShard' in log
    a = read_dcp_checkpoint(tmp_path / 'fsdp2' / 'iter_4')
    b = read_dcp_checkpoint(tmp_path / 'one' / 'iter_4')
    assert a['state_dict'].keys() == b['state_dict'].keys()
    errors = relative_error(a['state_dict'], b['state_dict'])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RELATIVE_ERROR, (worst, errors[worst])
    kinds = {k for s in a['optimizer']['state'].values() for k in s}
    assert {'momentum_buffer', 'exp_avg', 'exp_avg_sq'} <= kinds
    matrix = [g['matrix'] for g in a['optimizer']['param_groups']]
    assert matrix == [True, False]
