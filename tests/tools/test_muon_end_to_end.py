"""Muon through the real launcher, as a user runs it:
``bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_muon.py
N`` under DDP (2 ranks; a user's config naming MMEngine's wrapper on top of
the shipped one), FSDP2 (2 ranks), FSDP2 x tp=2 (4 ranks), pp=2 (2 ranks) and, with
mixture-of-experts blocks, ep=2 x FSDP2 (2 ranks; the 3-D expert weights go
to AdamW) ends with the weights ``tools/train.py`` reaches on one process on
the same global batch (6 optimizer steps of 2 accumulated micro-batches, clipping
cutting in every step); resuming FSDP2 halfway is bit-exact, and FSDP2's
checkpoint resumes under FSDP2 x tp=2 (Muon's momentum resharded by DCP).

One launch per layout: the one-process references and the FSDP2 run (whose
halfway checkpoint both resumes start from) are shared by the module.
"""
import re

import pytest

from tests.configs.test_llama_configs import SHRINK
from tests.e2e import (ROOT, assert_same_training_state, read_dcp_checkpoint,
                       run_tool)
from tests.optim.test_muon_layouts import RELATIVE_ERROR, relative_error

CONFIG = 'configs/llama_shakespeare/llama_shakespeare_muon.py'
# 6 optimizer steps of 2 micro-batches: enough for a wrong layout to show.
# Muon orthogonalising each rank's shard instead of the whole matrix ends
# 0.08-0.14 away (relative) from one process after 6 steps, 0.17-0.30
# after 10, but only 0.046 (inside RELATIVE_ERROR) after 4.
ITERS = 12
MAX_NORM = 0.5  # the gradient norm is 0.79-0.86 throughout: every step clips
OPTIONS = [f'{k}={v}' for k, v in SHRINK.items()] + [
    f'train_cfg.max_iters={ITERS}', 'train_cfg.val_interval=100',
    f'default_hooks.checkpoint.interval={ITERS // 2}', 'custom_hooks=[]',
    'optim_wrapper.accumulative_counts=2',
    f'optim_wrapper.clip_grad.max_norm={MAX_NORM}']
MOE = ['model.moe.num_experts=4', 'model.moe.top_k=2',
       'model.moe.hidden_dim=32']
# The one-process references: name -> options.
REFERENCES = {'one': [], 'one_moe': MOE}
# name -> (ranks, options, reference): the global batch is 8 windows.
TP2 = ['parallel.tp=2', 'parallel.tp_plan=llama']
LAYOUTS = {
    'ddp': (2, ['train_dataloader.batch_size=4'], 'one'),
    'fsdp2': (2, ['train_dataloader.batch_size=4'], 'one'),
    'tp2_fsdp2': (4, ['train_dataloader.batch_size=4', *TP2], 'one'),
    'pp2': (2, ['train_dataloader.batch_size=8', 'parallel.pp=2',
                'parallel.pipeline.schedule=1F1B',
                'parallel.pipeline.num_microbatches=2'], 'one'),
    'ep2_fsdp2': (2, ['train_dataloader.batch_size=4', 'parallel.ep=2',
                      *MOE], 'one_moe'),
}


# A user's config: the shipped Muon config under MMEngine's DDP wrapper.
USER_CONFIGS = {
    'ddp': (f"_base_ = ['{ROOT / CONFIG}']\n"
            "model_wrapper_cfg = dict(_delete_=True, "
            "type='MMDistributedDataParallel')\n"),
}


def _dist_train(work_dir, layout, *extra):
    ranks, options, _ = LAYOUTS[layout]
    config = CONFIG
    if layout in USER_CONFIGS:
        config = work_dir.parent / f'{work_dir.name}_{layout}.py'
        config.write_text(USER_CONFIGS[layout])
    return run_tool(['bash', 'tools/dist_train.sh', config, ranks,
                     '--work-dir', work_dir, *extra, '--cfg-options',
                     *OPTIONS, *options])


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """``runs(name)``: (work dir, log) of a one-process reference
    (REFERENCES) or a layout's launch, each launched once for the module."""
    done = {}

    def get(name):
        if name not in done:
            work_dir = tmp_path_factory.mktemp(f'muon_{name}')
            proc = run_tool(
                ['python', 'tools/train.py', CONFIG, '--work-dir', work_dir,
                 '--cfg-options', *OPTIONS, 'train_dataloader.batch_size=8',
                 *REFERENCES[name]]
            ) if name in REFERENCES else _dist_train(work_dir, name)
            done[name] = work_dir, proc.stdout + proc.stderr
        return done[name]

    return get


def _final(work_dir) -> dict:
    return read_dcp_checkpoint(work_dir / f'iter_{ITERS}')


def _assert_within_tolerance(actual: dict, expected: dict) -> None:
    assert actual['state_dict'].keys() == expected['state_dict'].keys()
    errors = relative_error(actual['state_dict'], expected['state_dict'])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RELATIVE_ERROR, (worst, errors[worst])


def test_reference_clips_every_step(runs):
    _, log = runs('one')
    # Logged from the first optimizer step on (iteration 2).
    norms = [float(n) for n in re.findall(r'grad_norm: ([0-9.]+)', log)]
    assert len(norms) >= ITERS - 1 and min(norms) > MAX_NORM, norms


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_dist_train_muon_matches_one_process(runs, layout):
    work_dir, log = runs(layout)
    assert "type='Muon'" in log
    if layout == 'ddp':
        assert "type='MMDistributedDataParallel'" in log
    a, b = _final(work_dir), _final(runs(LAYOUTS[layout][2])[0])
    _assert_within_tolerance(a, b)
    kinds = {k for s in a['optimizer']['state'].values() for k in s}
    assert {'momentum_buffer', 'exp_avg', 'exp_avg_sq'} <= kinds
    # Muon's and AdamW's groups (one pair per pipeline stage).
    matrix = [g['matrix'] for g in a['optimizer']['param_groups']]
    assert matrix == [True, False] * (2 if layout == 'pp2' else 1)


def test_fsdp2_resume_is_bit_exact(runs, tmp_path):
    straight, _ = runs('fsdp2')
    _dist_train(tmp_path, 'fsdp2', '--resume', straight / f'iter_{ITERS // 2}')
    assert not (tmp_path / f'iter_{ITERS // 2}').exists()  # resumed
    assert_same_training_state(_final(tmp_path), _final(straight))


def test_fsdp2_checkpoint_resumes_under_tp2_fsdp2(runs, tmp_path):
    """Saved by 2 FSDP2 ranks, loaded by 4 (2 data x 2 tp): every tensor,
    Muon's momentum included, resharded by DCP; the data position kept."""
    straight, _ = runs('fsdp2')
    _dist_train(tmp_path, 'tp2_fsdp2', '--resume',
                straight / f'iter_{ITERS // 2}')
    assert not (tmp_path / f'iter_{ITERS // 2}').exists()  # resumed
    resumed = _final(tmp_path)
    assert resumed['meta']['iter'] == ITERS
    _assert_within_tolerance(resumed, _final(straight))
