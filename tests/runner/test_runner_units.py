"""Registries, AMP on CPU, the Runner at world size 1, CLI config."""
import pytest
import torch
from mmengine.model import is_model_wrapper
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS

from mmpar.cli import parse_train_args, train_config
from mmpar.optim import AmpOptimWrapper
from mmpar.registry import MODEL_WRAPPERS, MODELS, OPTIM_WRAPPERS
from mmpar.wrappers import MMDistributedDataParallel
from tests.e2e import DEFAULT_CONFIG


def test_registries_are_children_with_mmpar_scope():
    assert MODEL_WRAPPERS.parent is MMENGINE_MODEL_WRAPPERS
    assert MODEL_WRAPPERS.scope == 'mmpar'
    assert MODEL_WRAPPERS.get('MMDistributedDataParallel') is \
        MMDistributedDataParallel
    # Falls back to MMEngine's entries.
    assert MODELS.get('BaseDataPreprocessor') is not None


def test_mmengine_recognises_mmpar_wrappers():
    wrapper = MMDistributedDataParallel.__new__(MMDistributedDataParallel)
    assert is_model_wrapper(wrapper)


@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU-only behaviour')
def test_amp_optim_wrapper_autocasts_bf16_on_cpu():
    model = torch.nn.Linear(4, 4)
    optim_wrapper = OPTIM_WRAPPERS.build(
        dict(
            type='AmpOptimWrapper',
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    assert isinstance(optim_wrapper, AmpOptimWrapper)
    with optim_wrapper.optim_context(model):
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    before = model.weight.detach().clone()
    optim_wrapper.update_params(out.float().pow(2).mean())
    assert not torch.equal(before, model.weight)
    assert optim_wrapper.state_dict()['loss_scaler'] == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU-only behaviour')
def test_amp_rejects_fp16_on_cpu():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="dtype='float16'.*bfloat16"):
        AmpOptimWrapper(
            dtype='float16',
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_amp_flag_and_resume_flags_set_config(tmp_path):
    cfg = train_config(
        parse_train_args([DEFAULT_CONFIG, '--amp', '--resume', '--work-dir',
                          str(tmp_path)]))
    assert cfg.optim_wrapper.type == 'mmpar.AmpOptimWrapper'
    assert cfg.resume is True and cfg.load_from is None
    assert cfg.work_dir == str(tmp_path)


def _tiny_runner(tmp_path, **extra):
    from mmengine.config import Config

    from mmpar.runner import Runner
    cfg = Config.fromfile(DEFAULT_CONFIG)
    cfg.work_dir = str(tmp_path)
    cfg.train_cfg.max_epochs = 1
    cfg.merge_from_dict(extra)
    return Runner.from_cfg(cfg)


def test_runner_does_not_wrap_at_world_size_one(tmp_path):
    runner = _tiny_runner(tmp_path)
    assert not is_model_wrapper(runner.model)
    assert runner.world_size == 1


def test_runner_amp_steps_in_bf16_on_cpu(tmp_path):
    runner = _tiny_runner(
        tmp_path, optim_wrapper=dict(type='mmpar.AmpOptimWrapper'))
    optim_wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
    assert isinstance(optim_wrapper, AmpOptimWrapper)
    batch = next(iter(runner.build_dataloader(runner._train_dataloader)))
    before = runner.model.head.weight.detach().clone()
    for _ in range(2):
        log_vars = runner.model.train_step(batch, optim_wrapper)
    assert torch.isfinite(log_vars['loss'])
    assert not torch.equal(before, runner.model.head.weight)


def test_runner_uses_gloo_for_nccl_without_cuda(tmp_path, monkeypatch):
    # Was refused; issue 11: OpenMMLab runtimes all say nccl, so on a CPU
    # machine mmpar warns once, naming the key, and uses gloo.
    if torch.cuda.is_available():
        pytest.skip('CPU-only behaviour')
    import torch.distributed as dist

    from mmpar.dist import free_port
    for key, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1,
                           MASTER_ADDR='127.0.0.1',
                           MASTER_PORT=free_port()).items():
        monkeypatch.setenv(key, str(value))
    # Recorded at the source: the message goes to MMEngine's current logger,
    # whose stream an earlier test's runner may own (the real output is
    # checked in tests/runner/test_plain_configs.py).
    import mmengine.logging
    logged = []
    monkeypatch.setattr(mmengine.logging, 'print_log',
                        lambda msg, **kwargs: logged.append(msg))
    _tiny_runner(tmp_path, launcher='pytorch',
                 env_cfg=dict(dist_cfg=dict(backend='nccl')))
    assert dist.get_backend() == 'gloo'
    warnings = [m for m in logged if 'env_cfg.dist_cfg.backend' in str(m)]
    assert len(warnings) == 1 and "'nccl' needs CUDA" in warnings[0]


def test_resume_restores_the_saved_rng_state(tmp_path):
    first = _tiny_runner(tmp_path, experiment_name='rng_first')
    first.train()
    saved = torch.load(tmp_path / 'epoch_1.pth', weights_only=True)
    assert len(saved['rng_states']) == 1
    torch.manual_seed(12345)  # anything but the saved state
    second = _tiny_runner(
        tmp_path, experiment_name='rng_second', train_cfg=dict(max_epochs=2))
    second.resume(str(tmp_path / 'epoch_1.pth'))
    assert torch.equal(torch.get_rng_state(), saved['rng_states'][0]['torch'])
