"""The bad-input catalogue: every case fails at start-up, in-process, with a
message naming the key, the bad value and what is allowed.

docs/troubleshooting.md lists the same cases; tests/test_bad_input_cli.py
runs a few of them through tools/train.py.
"""
import copy

import pytest
import torch
from mmengine.config import Config

from mmpar.config_check import check_config
from mmpar.failures import ConfigError
from tests.e2e import DEFAULT_CONFIG, ROOT

DELETE = object()
FSDP = 'MMFullyShardedDataParallel'

# case: ({dotted key: new value or DELETE}, [texts the message must contain])
CASES = {
    'unknown wrapper': ({
        'model_wrapper_cfg': dict(type='MMNope')
    }, ["model_wrapper_cfg.type='MMNope'", 'MMDistributedDataParallel']),
    'unknown sync strategy': ({
        'model_wrapper_cfg': dict(sync_strategy='sometimes')
    }, ["sync_strategy='sometimes'", 'single_auto_sync, multi_auto_sync']),
    'FSDP-only key on DDP': ({
        'model_wrapper_cfg': dict(sharding_strategy='FULL_SHARD')
    }, ["model_wrapper_cfg.sharding_strategy='FULL_SHARD'",
        'MMDistributedDataParallel takes no argument', 'bucket_cap_mb']),
    'negative bucket_cap_mb': ({
        'model_wrapper_cfg': dict(bucket_cap_mb=-1)
    }, ['model_wrapper_cfg.bucket_cap_mb=-1', 'a number > 0']),
    'non-bool find_unused_parameters': ({
        'model_wrapper_cfg': dict(find_unused_parameters='yes')
    }, ["find_unused_parameters='yes'", 'True, False']),
    'negative bucket_cap_mb (bucketed DP)': ({
        'model_wrapper_cfg': dict(type='MMBucketDataParallel', bucket_cap_mb=-1)
    }, ['bucket_cap_mb=-1', 'a number of MiB > 0']),
    'grad_dtype fp12 (bucketed DP)': ({
        'model_wrapper_cfg': dict(type='MMBucketDataParallel',
                                  grad_dtype='fp12')
    }, ["grad_dtype='fp12'", 'float32, float64, bfloat16']),
    'DDP-only key on naive DP': ({
        'model_wrapper_cfg': dict(type='MMNaiveDataParallel',
                                  find_unused_parameters=True)
    }, ['model_wrapper_cfg.find_unused_parameters=True',
        'MMNaiveDataParallel takes no argument', 'sync_strategy']),
    'unknown parallel key': ({
        'parallel': dict(mp=2)
    }, ['parallel.mp=2', 'model_parallelism, pipeline_parallelism']),
    'string model_parallelism': ({
        'parallel': dict(model_parallelism='2')
    }, ["parallel.model_parallelism='2'", 'an int >= 1']),
    'tp and its seed name disagree': ({
        'parallel': dict(tp=2, model_parallelism=4, tp_plan='digits_vit')
    }, ['parallel.tp=2', 'parallel.model_parallelism=4', 'disagree']),
    'two axes set to -1': ({
        'parallel': dict(dp_shard=-1, dp_replicate=-1)
    }, ['dp_replicate and dp_shard are both -1', 'at most one axis']),
    'zero dp_shard': ({
        'parallel': dict(dp_shard=0)
    }, ['parallel.dp_shard=0', 'an int >= 1, or -1']),
    'pipeline not a dict': ({
        'parallel': dict(pipeline='1F1B')
    }, ["parallel.pipeline='1F1B'", 'None or a dict']),
    'unknown sharding strategy': ({
        'parallel': dict(use_fsdp=True, sharding_strategy='FULLY')
    }, ["parallel.sharding_strategy='FULLY'", 'FULL_SHARD, SHARD_GRAD_OP']),
    "cpu_offload='yes'": ({
        'parallel': dict(use_fsdp=True, cpu_offload='yes')
    }, ["parallel.cpu_offload='yes'", 'True or False']),
    'sync_module_states without use_fsdp': ({
        'parallel': dict(sync_module_states=False)
    }, ['parallel.sync_module_states=False is an FSDP option',
        'parallel.use_fsdp=False', 'leave sync_module_states at True']),
    'unknown FSDP wrap policy': ({
        'model_wrapper_cfg': dict(type=FSDP, fsdp_auto_wrap_policy='by_sizee')
    }, ["fsdp_auto_wrap_policy='by_sizee'", 'module_class, size_based']),
    'unknown FSDP wrap policy in a dict': ({
        'model_wrapper_cfg': dict(type=FSDP,
                                  fsdp_auto_wrap_policy=dict(type='nope'))
    }, ["fsdp_auto_wrap_policy='nope'", 'module_class, size_based']),
    'unknown FSDP2 wrap policy': ({
        'model_wrapper_cfg': dict(type='MMFullyShard',
                                  fsdp_auto_wrap_policy='nope')
    }, ["fsdp_auto_wrap_policy='nope'", 'size_based']),
    "FSDP cpu_offload='yes'": ({
        'model_wrapper_cfg': dict(type=FSDP, cpu_offload='yes')
    }, ["cpu_offload='yes'", 'None, a bool or']),
    'unknown FSDP sharding strategy': ({
        'model_wrapper_cfg': dict(type=FSDP, sharding_strategy='FULLY')
    }, ["sharding_strategy='FULLY'", 'FULL_SHARD, SHARD_GRAD_OP']),
    'FSDP mixed precision fp12': ({
        'model_wrapper_cfg': dict(type=FSDP,
                                  mixed_precision=dict(param_dtype='fp12'))
    }, ["mixed_precision.param_dtype='fp12'", 'bf16, bfloat16']),
    'unknown tp_plan argument': ({
        'parallel': dict(tp=2, tp_plan=dict(type='digits_vit',
                                            sequence_parallel=False))
    }, ['parallel.tp_plan.sequence_parallel=False',
        "digits_vit_tp_plan() takes no argument 'sequence_parallel'",
        'no keys besides type']),
    'unknown module_plan argument': ({
        'parallel': dict(tp=2, tp_plan=dict(
            type='module_plan', plan={'blocks.*.mlp.fc1': 'colwise'},
            strict=True))
    }, ['parallel.tp_plan.strict=True', 'allowed: plan']),
    'misspelt fully_shard argument (FSDP2)': ({
        'model_wrapper_cfg': dict(type='MMFullyShard',
                                  reshard_after_foward=False)
    }, ['model_wrapper_cfg.reshard_after_foward=False',
        "MMFullyShard takes no argument 'reshard_after_foward'",
        'reshard_after_forward', 'shard_placement_fn']),
    'DDP key on FSDP': ({
        'model_wrapper_cfg': dict(type=FSDP, bucket_cap_mb=25)
    }, ['model_wrapper_cfg.bucket_cap_mb=25',
        'MMFullyShardedDataParallel takes no argument', 'sharding_strategy']),
    'wrapper cfg not a dict': ({
        'model_wrapper_cfg': 'ddp'
    }, ['model_wrapper_cfg must be a dict', 'str']),
    'missing model': ({
        'model': DELETE
    }, ['no "model"', 'model=dict(type=...)']),
    'model not a dict': ({
        'model': 'vit'
    }, ["model='vit'", 'a dict with a "type"']),
    'model without type': ({
        'model.type': DELETE
    }, ['model has no "type"', 'DigitsViT']),
    'unknown model': ({
        'model.type': 'ResNet9000'
    }, ["model.type='ResNet9000'", 'DigitsViT']),
    'missing dataset': ({
        'train_dataloader.dataset': DELETE
    }, ['train_dataloader has no "dataset"']),
    'unknown dataset': ({
        'train_dataloader.dataset.type': 'ImageNet'
    }, ["train_dataloader.dataset.type='ImageNet'", 'DigitsDataset']),
    'zero batch size': ({
        'train_dataloader.batch_size': 0
    }, ['train_dataloader.batch_size=0', 'an int >= 1']),
    'string batch size': ({
        'val_dataloader.batch_size': '64'
    }, ["val_dataloader.batch_size='64'", 'an int >= 1']),
    'negative num_workers': ({
        'train_dataloader.num_workers': -2
    }, ['train_dataloader.num_workers=-2', 'an int >= 0']),
    'unknown sampler': ({
        'train_dataloader.sampler.type': 'RandomSampler9'
    }, ["sampler.type='RandomSampler9'", 'DefaultSampler']),
    'train loader without optim_wrapper': ({
        'optim_wrapper': DELETE
    }, ['optim_wrapper missing', 'all of train_dataloader, train_cfg, '
        'optim_wrapper']),
    'val loader without evaluator': ({
        'val_evaluator': DELETE
    }, ['val_evaluator missing']),
    'unknown optimizer': ({
        'optim_wrapper.optimizer.type': 'Adamm'
    }, ["optim_wrapper.optimizer.type='Adamm'", 'AdamW']),
    'missing optimizer': ({
        'optim_wrapper.optimizer': DELETE
    }, ['optim_wrapper has no "optimizer"']),
    'unknown optim wrapper': ({
        'optim_wrapper.type': 'FancyWrapper'
    }, ["optim_wrapper.type='FancyWrapper'", 'AmpOptimWrapper']),
    'zero accumulative_counts': ({
        'optim_wrapper.accumulative_counts': 0
    }, ['optim_wrapper.accumulative_counts=0', 'an int >= 1']),
    'unknown clip_grad type': ({
        'optim_wrapper.clip_grad.type': 'l3'
    }, ["optim_wrapper.clip_grad.type='l3'", 'norm, value']),
    'negative clip max_norm': ({
        'optim_wrapper.clip_grad': dict(max_norm=-1.0)
    }, ['optim_wrapper.clip_grad.max_norm=-1.0', 'a number > 0']),
    'misspelt clip_grad key': ({
        'optim_wrapper.clip_grad': dict(maxnorm=1.0)
    }, ['optim_wrapper.clip_grad.maxnorm=1.0', "no argument 'maxnorm'",
        'allowed: type, max_norm, norm_type, error_if_nonfinite']),
    'clip norm_type not a number': ({
        'optim_wrapper.clip_grad': dict(max_norm=1.0, norm_type='two')
    }, ["optim_wrapper.clip_grad.norm_type='two'", "a number > 0",
        "'inf'"]),
    'value clip without clip_value': ({
        'optim_wrapper.clip_grad': dict(type='value', max_norm=1.0)
    }, ['optim_wrapper.clip_grad.max_norm=1.0', "type='value'",
        'allowed: type, clip_value, foreach']),
    'typo in train_cfg': ({
        'train_cfg.max_epoch': 3
    }, ["train_cfg.max_epoch=3", "unknown key 'max_epoch'", 'max_epochs']),
    'zero max_epochs': ({
        'train_cfg.max_epochs': 0
    }, ['train_cfg.max_epochs=0', 'an int >= 1']),
    'string max_epochs': ({
        'train_cfg.max_epochs': '3'
    }, ["train_cfg.max_epochs='3'", 'an int >= 1']),
    'unknown metric': ({
        'val_evaluator.type': 'F1'
    }, ["val_evaluator.type='F1'", 'Accuracy']),
    'unknown scheduler': ({
        'param_scheduler': [dict(type='WarmupCosine')]
    }, ["param_scheduler[0].type='WarmupCosine'", 'CosineAnnealingLR']),
    'unknown hook': ({
        'custom_hooks': [dict(type='EMAHookk')]
    }, ["custom_hooks[0].type='EMAHookk'", 'NonFiniteLossHook']),
    'bad NonFiniteLossHook action': ({
        'custom_hooks': [dict(type='NonFiniteLossHook', action='retry')]
    }, ["action='retry'", 'stop, skip']),
    'zero checkpoint interval': ({
        'default_hooks.checkpoint.interval': 0
    }, ['default_hooks.checkpoint.interval=0', 'an int >= 1, or -1']),
    'unknown backend': ({
        'env_cfg.dist_cfg.backend': 'mpi'
    }, ["env_cfg.dist_cfg.backend='mpi'", 'gloo, nccl']),
    'unknown sync_bn': ({
        'sync_bn': 'apex'
    }, ["sync_bn='apex'", "None, 'torch', 'mmcv'"]),
    'negative timeout': ({
        'env_cfg.dist_cfg.timeout': -5
    }, ['env_cfg.dist_cfg.timeout=-5', 'a number > 0']),
    'missing custom_imports module': ({
        'custom_imports': dict(imports=['mmpar_plugins_nope'])
    }, ["custom_imports.imports='mmpar_plugins_nope'",
        'cannot be imported']),
    'custom_imports not a dict': ({
        'custom_imports': ['my_module']
    }, ["custom_imports=['my_module']", 'dict(imports=']),
    'missing load_from checkpoint': ({
        'load_from': 'work_dirs/none/epoch_9.pth'
    }, ["load_from='work_dirs/none/epoch_9.pth'", 'does not exist']),
    'missing resume checkpoint': ({
        'resume': True,
        'load_from': 'nope.pth'
    }, ["load_from (resume)='nope.pth'", 'does not exist']),
    'unknown checkpoint_format': ({
        'checkpoint_format': 'dcp'
    }, ["checkpoint_format='dcp'", "'full', 'sharded'"]),
    'sharded checkpoints of a fused tp split': ({
        'checkpoint_format': 'sharded',
        'parallel': dict(tp=2, tp_plan=dict(type='module_plan', plan={
            'blocks.*.attn.qkv': dict(style='colwise', fused=3)}))
    }, ["checkpoint_format='sharded' is not allowed",
        'blocks.*.attn.qkv', "allowed: checkpoint_format='full'"]),
    'published_keys with sharded checkpoints': ({
        'checkpoint_format': 'sharded',
        'default_hooks.checkpoint.published_keys': ['meta', 'state_dict']
    }, ["default_hooks.checkpoint.published_keys=['meta', 'state_dict']",
        "checkpoint_format='sharded'", "allowed: checkpoint_format='full'",
        'tools/convert_checkpoint.py']),
    'unknown log level': ({
        'log_level': 'LOUD'
    }, ["log_level='LOUD'", 'DEBUG, INFO, WARNING, ERROR, CRITICAL']),
    'unknown model argument': ({
        'model.embed_dims': 64
    }, ['model.embed_dims=64', "DigitsViT takes no argument 'embed_dims'",
        'embed_dim']),
    'non-int seed': ({
        'randomness.seed': 'zero'
    }, ["randomness.seed='zero'", 'an int or None']),
}


@pytest.fixture(scope='module')
def base_cfg():
    return Config.fromfile(str(ROOT / DEFAULT_CONFIG)).to_dict()


def _apply(cfg: dict, changes: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        *parents, last = dotted.split('.')
        node = cfg
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return cfg


def test_default_config_passes(base_cfg):
    # One process, nothing split: the layout the Runner then builds.
    plan = check_config(base_cfg)
    parallel, dims = plan.parallel, plan.dims
    assert (dims.world_size, dims.dp, dims.tp, dims.pp, dims.cp) == (
        1, 1, 1, 1, 1)
    assert parallel.use_fsdp is False and parallel.tp_plan is None


def test_catalogue_has_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize('case', sorted(CASES))
def test_bad_config_is_rejected_with_key_value_and_allowed(case, base_cfg):
    changes, expected = CASES[case]
    cfg = _apply(base_cfg, changes)
    with pytest.raises((ConfigError, ValueError, TypeError)) as info:
        check_config(cfg)
    message = str(info.value)
    for text in expected:
        assert text in message, f'{case}: {text!r} not in {message!r}'


def test_topology_sizes_must_divide_the_world_size(base_cfg, monkeypatch):
    # As torchrun would announce a 2-process job.
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    cfg = _apply(base_cfg, {
        'launcher': 'pytorch',
        'parallel': dict(pipeline_parallelism=3)
    })
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    assert 'world size 2 is not divisible' in str(info.value)
    assert 'pipeline_parallelism' in str(info.value)
    # pp=2 divides 2; a pipeline split is needed for pp > 1 (issue 11).
    check_config(_apply(cfg, {'parallel': dict(pipeline_parallelism=2,
                                               pipeline=dict())}))


def _as_torchrun(monkeypatch, world_size):
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', str(world_size))
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')


@pytest.mark.parametrize('section,named', [
    # Issue 11: default DDP with mp=2 at 4 ranks trained two different
    # models without a word.
    (dict(model_parallelism=2), ['parallel.model_parallelism=2',
                                 'parallel.tp_plan is not set']),
    (dict(pipeline_parallelism=2), ['parallel.pipeline_parallelism=2',
                                    'parallel.pipeline']),
])
def test_layouts_that_cannot_train_are_refused(base_cfg, monkeypatch,
                                               section, named):
    _as_torchrun(monkeypatch, 4)
    cfg = _apply(base_cfg, {'launcher': 'pytorch', 'parallel': section})
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    for text in named:
        assert text in str(info.value)


PP_TP = dict(pp=2, tp=2, tp_plan='digits_vit', pipeline=dict(schedule='1F1B'))


@pytest.mark.parametrize('world_size,wrapper', [
    (4, None), (8, dict(type='MMFullyShard')),
    (8, dict(type='MMDistributedDataParallel'))])
def test_pp_x_tp_passes(base_cfg, monkeypatch, world_size, wrapper):
    # 2-D (pp x tp) and 3-D (pp x tp x the data axis).
    _as_torchrun(monkeypatch, world_size)
    dims = check_config(_apply(base_cfg, {
        'launcher': 'pytorch', 'parallel': PP_TP,
        'model_wrapper_cfg': wrapper})).dims
    assert (dims.pp, dims.tp, dims.dp, dims.world_size) == (
        2, 2, world_size // 4, world_size)


@pytest.mark.parametrize('changes,named', [
    ({'model_wrapper_cfg': dict(type=FSDP)},
     [f"model_wrapper_cfg.type='{FSDP}' with parallel.tp=2",
      "allowed: type='MMFullyShard'"]),
    ({'parallel': dict(PP_TP, pipeline=None)},
     ['parallel.pp=2', 'parallel.pipeline', 'dict(...)']),
    ({'parallel': dict(PP_TP, tp_plan=None)},
     ['parallel.tp=2', 'parallel.tp_plan is not set']),
    ({'parallel': dict(PP_TP, tp=3)},
     ['world size 8 is not divisible', 'pp=2 * tp=3']),
])
def test_pp_x_tp_mistakes_are_refused(base_cfg, monkeypatch, changes,
                                      named):
    _as_torchrun(monkeypatch, 8)
    cfg = _apply(base_cfg, dict({'launcher': 'pytorch', 'parallel': PP_TP},
                                **changes))
    with pytest.raises((ConfigError, ValueError)) as info:
        check_config(cfg)
    for text in named:
        assert text in str(info.value)


def test_hsdp_alias_passes(base_cfg, monkeypatch):
    _as_torchrun(monkeypatch, 4)
    plan = check_config(_apply(base_cfg, {
        'launcher': 'pytorch',
        'parallel': dict(model_parallelism=2, use_fsdp=True,
                         sharding_strategy='HYBRID_SHARD')}))
    parallel, dims = plan.parallel, plan.dims
    # The seed's HSDP meaning: shard groups of model_parallelism ranks,
    # replicated over the rest; no tensor parallelism.
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 1)
    assert parallel.tp is None


def test_nccl_without_cuda_is_not_an_error(base_cfg):
    # The Runner warns and uses gloo (OpenMMLab runtimes all ask for nccl):
    # the check passes the config with the layout it had.
    assert check_config(_apply(
        base_cfg, {'env_cfg.dist_cfg.backend': 'nccl'})) == check_config(
            base_cfg)


def test_check_does_not_change_the_config(base_cfg):
    cfg = copy.deepcopy(base_cfg)
    check_config(cfg)
    assert cfg == base_cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU-only refusal')
def test_sync_bn_on_cpu_refused_when_launched(base_cfg):
    # torch would fail deep inside DDP: "SyncBatchNorm layers only work
    # with GPU modules".
    with pytest.raises(ConfigError) as err:
        check_config(_apply(base_cfg, {'sync_bn': 'torch',
                                       'launcher': 'pytorch'}))
    assert "sync_bn='torch'" in str(err.value)
    assert 'needs CUDA' in str(err.value) and 'None' in str(err.value)


def test_sync_bn_ignored_on_one_process(base_cfg):
    # One process never converts BatchNorm (the Runner reverts it): the
    # check that refuses it when launched (above) lets it pass here.
    assert check_config(_apply(
        base_cfg, {'sync_bn': 'torch', 'launcher': 'none'})) == check_config(
            base_cfg)


@pytest.mark.parametrize('on_mmpars_base', [False, True])
def test_a_users_wrapper_checks_its_own_arguments(base_cfg, on_mmpars_base):
    # A wrapper of the user's own, on mmpar's base (StepMixin) or not, with
    # a check_cfg that does not call super(): the builder calls it at
    # start-up, and mmpar's shared checks (sync_strategy) still run.
    from mmpar.registry import MODEL_WRAPPERS
    from mmpar.wrappers.base import StepMixin

    class OwnSteps(torch.nn.Module):
        # Off mmpar's base a wrapper brings MMEngine's step interface itself,
        # as MMEngine's wrappers do: the Runner trains through train_step.

        def train_step(self, data, optim_wrapper):
            return self.module.train_step(data, optim_wrapper)

    bases = (StepMixin, torch.nn.Module) if on_mmpars_base else (OwnSteps, )

    class UsersWrapper(*bases):

        @classmethod
        def check_cfg(cls, cfg):
            if cfg.get('overlap') not in (None, True, False):
                raise ValueError(f'model_wrapper_cfg.overlap='
                                 f'{cfg["overlap"]!r}; allowed: True, False')

    name = 'TestUsersWrapper'
    MODEL_WRAPPERS.register_module(name=name, module=UsersWrapper)
    try:
        cfg = _apply(base_cfg, {'model_wrapper_cfg': dict(type=name)})
        check_config(cfg)
        cfg['model_wrapper_cfg']['overlap'] = 'yes'
        with pytest.raises(ValueError, match="overlap='yes'; allowed"):
            check_config(cfg)
        cfg['model_wrapper_cfg'] = dict(type=name, sync_strategy='often')
        with pytest.raises(ValueError, match="sync_strategy='often'"):
            check_config(cfg)
    finally:
        del MODEL_WRAPPERS.module_dict[name]


@pytest.mark.parametrize('name,why', [
    ('DataParallel', 'no train_step'),
    ('DistributedDataParallel', 'no train_step'),
    ('MMPipelineParallel', 'parallel.pp and parallel.pipeline')])
def test_registered_classes_that_cannot_wrap_are_refused(base_cfg, name, why):
    # torch's DataParallel / DistributedDataParallel (in MMEngine's
    # registry) have no train_step; mmpar's pipeline wrapper is built by
    # pipeline_parallelize. They failed at run time (TypeError,
    # AttributeError); now at start-up, and are not offered as allowed.
    cfg = _apply(base_cfg, {'model_wrapper_cfg': dict(type=name)})
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    message = str(info.value)
    assert f"model_wrapper_cfg.type={name!r}" in message and why in message
    allowed = message.split('allowed: ')[-1].split(', ')
    assert 'MMDistributedDataParallel' in allowed and name not in allowed


@pytest.mark.parametrize('schedule', ['ZBVZeroBubble', 'DualPipeV'])
def test_v_schedule_with_a_val_loop_is_refused(base_cfg, monkeypatch,
                                               schedule):
    # torch 2.13 cannot evaluate a V schedule: the run failed at its first
    # validation. A training-only job (the test loop a config inherits is
    # never run by training) still passes.
    _as_torchrun(monkeypatch, 2)
    cfg = _apply(base_cfg, {'launcher': 'pytorch', 'parallel': dict(
        pp=2, pipeline=dict(schedule=schedule, stages_per_rank=2))})
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    for text in (f'parallel.pipeline.schedule={schedule!r}',
                 'val_dataloader and val_cfg are set', '1F1B'):
        assert text in str(info.value)
    check_config(_apply(cfg, {'val_dataloader': None, 'val_cfg': None,
                              'val_evaluator': None}))


def test_fully_shard_arguments_forwarded_to_torch_pass(base_cfg):
    # MMFullyShard passes **kwargs to torch's fully_shard: its arguments
    # are allowed (the typo above is refused with them listed).
    check_config(_apply(base_cfg, {'model_wrapper_cfg': dict(
        type='MMFullyShard', shard_placement_fn=None, ignored_params=None)}))


@pytest.mark.parametrize('clip_grad', [
    dict(max_norm=1.0, norm_type='inf'), dict(max_norm=0.5, norm_type=1),
    dict(type='value', clip_value=0.1),
    dict(max_norm=1.0, error_if_nonfinite=True, foreach=None)])
def test_clip_grad_forms_the_optim_wrapper_takes_pass(base_cfg, clip_grad):
    check_config(_apply(base_cfg, {'optim_wrapper.clip_grad': clip_grad}))
