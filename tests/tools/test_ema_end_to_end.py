"""MMEngine's EMAHook through the real launcher, under every wrapper.

``tests/data/ema_digits.py`` (the digits ViT, 20 iterations, EMAHook with
momentum 0.01 and ``update_buffers=True``) is trained once on one process
(the reference) and once per layout with ``tools/dist_train.sh`` on 2
ranks: DDP, FSDP1, FSDP2, tp=2 and pp=2, each on the same global batch of
64. Each run's full checkpoint holds ``ema_state_dict`` and, swapped in for
deployment, the averaged weights as ``state_dict``, equal to the
reference's within the parity tolerance (after 20 AdamW steps the model's
own weights are about 0.02 away from the average, far outside it), and
loads into the plain model; validation logged the reference's accuracies.
``tools/test.py`` on the FSDP2 run's checkpoint (gathered from shards)
reports the accuracy validation logged during training; the other layouts'
checkpoints hold the same weights, so it is run once. The FSDP2 run's
iteration-10 checkpoint resumed under DDP and on one process continues the
average.
"""
import re

import pytest

from mmpar.models import DigitsViT
from tests.e2e import ROOT, load_ckpt, run_tool
from tests.toy import assert_states_close

CONFIG = 'tests/data/ema_digits.py'
POLICY = "dict(type='module_class', module_classes=['TransformerBlock'])"
# Per layout: the config lines on top of CONFIG. Data-parallel layouts read
# half the global batch per rank; tp and pp peers read the same batch.
LAYOUTS = {
    'ddp': ['train_dataloader = dict(batch_size=32)'],
    'fsdp1': ['train_dataloader = dict(batch_size=32)',
              "model_wrapper_cfg = dict(type='MMFullyShardedDataParallel', "
              f'fsdp_auto_wrap_policy={POLICY})'],
    'fsdp2': ['train_dataloader = dict(batch_size=32)',
              "model_wrapper_cfg = dict(type='MMFullyShard', "
              f'fsdp_auto_wrap_policy={POLICY})'],
    'tp': ["parallel = dict(tp=2, tp_plan='digits_vit')"],
    'pp': ["parallel = dict(pp=2, pipeline=dict(split_points=['blocks.2'], "
           "schedule='1F1B', num_microbatches=4))"],
}
FINAL = 'iter_20.pth'
MIDDLE = 'iter_10.pth'


def _accuracies(proc) -> list:
    return [float(a) for a in re.findall(r'accuracy/top1: ([\d.]+)',
                                         proc.stdout + proc.stderr)]


def _assert_same_average(actual: dict, expected: dict) -> None:
    for key in ('state_dict', 'ema_state_dict'):
        assert_states_close(actual[key], expected[key])


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """One process on the global batch: (work dir, validation accuracies)."""
    work = tmp_path_factory.mktemp('ema_one')
    proc = run_tool(['python', 'tools/train.py', CONFIG, '--work-dir', work])
    return work, _accuracies(proc)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """``trained(layout)``: that layout's run (once per module)."""
    runs = {}

    def train(layout):
        if layout not in runs:
            work = tmp_path_factory.mktemp(f'ema_{layout}')
            config = work / 'config.py'
            config.write_text('\n'.join(
                [f"_base_ = '{ROOT / CONFIG}'"] + LAYOUTS[layout])
                + '\n')
            proc = run_tool(['bash', 'tools/dist_train.sh', config, 2,
                             '--work-dir', work])
            runs[layout] = work, _accuracies(proc)
        return runs[layout]

    return train


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_ema_equals_one_process(reference, trained, layout):
    work, logged = trained(layout)
    checkpoint = load_ckpt(work / FINAL)
    _assert_same_average(checkpoint, load_ckpt(reference[0] / FINAL))
    plain = DigitsViT(embed_dim=32, depth=4, num_heads=2)
    plain.load_state_dict(checkpoint['state_dict'], strict=True)
    assert list(checkpoint['ema_state_dict']) == ['steps'] + [
        f'module.{k}' for k in plain.state_dict()]
    # Validation at iterations 10 and 20, on the averaged weights.
    assert logged == reference[1] and len(logged) == 2


def test_tools_test_evaluates_the_average(trained):
    work, logged = trained('fsdp2')
    tested = run_tool(['python', 'tools/test.py', CONFIG, work / FINAL,
                       '--work-dir', work / 'test'])
    assert _accuracies(tested) == logged[-1:]


@pytest.mark.parametrize('where', ['ddp', 'one process'])
def test_fsdp2_checkpoint_resumes_the_average(reference, trained, where,
                                              tmp_path):
    fsdp2, _ = trained('fsdp2')
    if where == 'ddp':
        args = ['bash', 'tools/dist_train.sh', CONFIG, 2, '--cfg-options',
                'train_dataloader.batch_size=32']
    else:
        args = ['python', 'tools/train.py', CONFIG]
    proc = run_tool(args + ['--work-dir', tmp_path, '--resume',
                            fsdp2 / MIDDLE])
    assert 'resumed' in (proc.stdout + proc.stderr).lower()
    # Iterations 11-20 go on from the saved average (steps 10), not from a
    # fresh copy of the weights.
    resumed = load_ckpt(tmp_path / FINAL)
    assert int(resumed['ema_state_dict']['steps']) == 20
    _assert_same_average(resumed, load_ckpt(reference[0] / FINAL))
