"""The CUDA paths, end to end through the real tools (``pytest -m gpu``).

Every test here is marked ``gpu`` and skipped when
``torch.cuda.is_available()`` is False (tests/conftest.py), so the CPU suite
collects them and skips them cleanly. ``bash tools/gpu_check.sh`` runs them and the CUDA benchmark smoke
run on a machine with a GPU. Each trains one epoch of the default example.
"""
import pytest
import torch

from tests.e2e import DEFAULT_CONFIG, ROOT, load_ckpt, run_tool, tool_env

pytestmark = pytest.mark.gpu

ONE_EPOCH = ['--cfg-options', 'train_cfg.max_epochs=1']
FSDP_CONFIGS = {
    'fsdp1': 'configs/vit_digits/vit_digits_fsdp.py',
    'fsdp2': 'configs/vit_digits/vit_digits_fsdp2.py',
}


def _train(tmp_path, *args, config=DEFAULT_CONFIG, nproc=None):
    work_dir = tmp_path / 'work'
    if nproc is None:
        cmd = ['python', 'tools/train.py', config]
    else:
        cmd = ['bash', 'tools/dist_train.sh', config, str(nproc)]
    proc = run_tool([*cmd, '--work-dir', work_dir, *ONE_EPOCH, *args])
    ckpt = work_dir / 'epoch_1.pth'
    assert ckpt.is_file(), proc.stdout[-2000:]
    return work_dir, ckpt, proc


def _assert_trained_on_cuda(ckpt, proc):
    state = load_ckpt(ckpt)['state_dict']
    assert state and all(torch.isfinite(v).all() for v in state.values()
                         if v.is_floating_point())
    text = proc.stdout + proc.stderr
    assert 'cuda' in text.lower(), text[-2000:]


def test_one_process_default_config(tmp_path):
    _, ckpt, proc = _train(tmp_path)
    _assert_trained_on_cuda(ckpt, proc)


def test_dist_train_nccl_world_size_1(tmp_path):
    _, ckpt, proc = _train(tmp_path, nproc=1)
    assert 'nccl' in (proc.stdout + proc.stderr).lower()
    _assert_trained_on_cuda(ckpt, proc)


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_amp(tmp_path, dtype):
    # float16 runs through GradScaler, bfloat16 without one.
    _, ckpt, proc = _train(tmp_path, '--amp',
                           f'optim_wrapper.dtype={dtype}')
    _assert_trained_on_cuda(ckpt, proc)
    if dtype == 'float16':
        # MMEngine's AmpOptimWrapper saves its GradScaler's state.
        assert 'loss_scaler' in load_ckpt(ckpt)['optimizer']


@pytest.mark.parametrize('cpu_offload', [False, True])
@pytest.mark.parametrize('kind', list(FSDP_CONFIGS))
def test_fsdp_world_size_1(tmp_path, kind, cpu_offload):
    _, ckpt, proc = _train(
        tmp_path, f'model_wrapper_cfg.cpu_offload={cpu_offload}',
        config=FSDP_CONFIGS[kind], nproc=1)
    _assert_trained_on_cuda(ckpt, proc)


def test_checkpoint_saved_on_cuda_loads_on_cpu(tmp_path):
    _, ckpt, _ = _train(tmp_path)
    # CUDA hidden: tools/test.py must map the CUDA tensors to the CPU.
    proc = run_tool(
        ['python', 'tools/test.py', DEFAULT_CONFIG, ckpt, '--work-dir',
         tmp_path / 'test_on_cpu'],
        env=tool_env(CUDA_VISIBLE_DEVICES=''))
    assert 'accuracy' in (proc.stdout + proc.stderr).lower()


def test_benchmark_quick_on_cuda(tmp_path):
    run_tool(['python', 'benchmarks/run.py', '--device', 'cuda',
              '--world-size', '1', '--quick', '--out', tmp_path])
    report = (tmp_path / 'benchmarks.md').read_text()
    assert 'peak CUDA / rank (MB)' in report


def test_mmengine_amp_optim_wrapper_adopted_under_ddp(tmp_path):
    # MMEngine's own AmpOptimWrapper (a downstream subclass, float16 with
    # its GradScaler) handed to mmpar's DDP wrapper (world size 1 on
    # NCCL): adopted, its step runs, and the scaler's state is saved.
    from tests.data.downstream_optim import AMP_STEP_MARKER
    config = tmp_path / 'amp_ddp.py'
    config.write_text(
        f"_base_ = ['{ROOT / DEFAULT_CONFIG}']\n"
        "custom_imports = dict(imports=['tests.data.downstream_optim'], "
        'allow_failed_imports=False)\n'
        "optim_wrapper = dict(type='DownstreamAmpOptimWrapper', "
        "dtype='float16')\n")
    _, ckpt, proc = _train(tmp_path, config=str(config), nproc=1)
    _assert_trained_on_cuda(ckpt, proc)
    assert AMP_STEP_MARKER in proc.stdout + proc.stderr
    assert 'loss_scaler' in load_ckpt(ckpt)['optimizer']
