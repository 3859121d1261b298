"""Every documented option and every pipeline schedule, through the tools.

Each registered pipeline schedule and each documented ``parallel`` /
``model_wrapper_cfg`` key (and the top-level ``activation_checkpointing``
and ``model_compile``) runs at least once through ``tools/dist_train.sh``,
as a user runs it: a config file naming the options, 4 iterations of the
tiny ViT of ``tests/data/options_vit.py`` on 2 processes (4 for pp x FSDP2,
``NPROC``). Several options share a launch where they combine, so the whole
coverage costs a few launches. ``test_every_documented_option_is_launched``
derives the keys from docs/ (the tables of docs/wrappers.md,
docs/wrappers/naive_bucket.md, docs/fsdp.md; the ``parallel`` and ``pipeline``
blocks of docs/topology.md and docs/pipeline_parallel.md) and from the code's
own key lists (each wrapper's arguments, ``ParallelConfig`` /
``PipelineConfig`` fields, the activation-checkpointing and compile keys), and
fails when one of them is in no launch below and not exempted with its reason;
each launch checks that the run saw its options (the config MMEngine dumps
into the work dir).

The pipeline launches are also checked against one process: every schedule
ends with the weights ``tools/train.py`` reaches on one process on the same
global batch (within fp32 summation noise), and ``Interleaved1F1B`` (2
virtual stages per rank) resumes through ``dist_train.sh --resume`` from
its iteration-2 checkpoint to the same iteration-4 state bit for bit.

Coverage (key -> launch; values that differ from the default in brackets):

============================== ============================================
``parallel``
dp_replicate                   ``ddp`` [2, with dp_shard=1]
dp_shard                       ``ddp`` [1], ``use_fsdp`` [2]
tp, model_parallelism          ``tp`` [2, both spellings]
pp, pipeline_parallelism       ``pp_GPipe`` [both spellings]; ``pp`` in
                               every ``pp_*`` launch
cp                             exempt here (the ViT has no cp attention):
                               tests/tools/test_cp_end_to_end.py
ep                             exempt here (the ViT has no experts):
                               tests/tools/test_ep_end_to_end.py
tp_plan                        ``tp`` [module_plan dict, a fused qkv:
                               ``dict(style='colwise', fused=3)``, on
                               examples/my_pkg/tp_vit.py's SplittableViT
                               with timm's attention]; the registered
                               name form in tests/parallelize/
                               test_tp_end_to_end.py
pipeline                       every ``pp_*`` launch
use_fsdp, sharding_strategy,   ``use_fsdp`` [True, SHARD_GRAD_OP, True];
sync_module_states             it also trains with ConvNeXt-V2's
                               ``optim_wrapper.paramwise_cfg``, whose
                               groups in its checkpoint equal one process's
cpu_offload                    exempt: FSDP1's, ``True`` needs CUDA
                               (tests/gpu/test_cuda_paths.py)
``parallel.pipeline``
split_points                   ``pp_GPipe``, ``pp_Interleaved1F1B``; left
                               out (even split) in the other ``pp_*``
schedule                       one ``pp_*`` launch per registered schedule;
                               1F1B: tests/parallelize/test_pp_end_to_end.py
                               (configs/vit_digits/vit_digits_pp.py)
num_microbatches               every ``pp_*`` launch [2 or 4]
stages_per_rank                ``pp_GPipe`` [1], virtual-stage launches [2]
reshard_per_microbatch         ``pp_fsdp2`` [True, the default],
                               ``pp_fsdp2_held`` [False] (pp=2 x dp_shard=2
                               on 4 processes); parity with one process:
                               tests/parallelize/
                               test_pipeline_fsdp_reshard.py
``MMDistributedDataParallel``  ``ddp``: sync_strategy [forced_sync],
                               buffer_sync [average], bucket_cap_mb [1],
                               find_unused_parameters, static_graph,
                               broadcast_buffers, gradient_as_bucket_view;
                               device_ids exempt (CUDA only)
``MMNaiveDataParallel``        ``naive``: sync_strategy [multi_auto_sync],
                               bucket_cap_mb, buffer_sync [None]
``MMBucketDataParallel``       ``bucket``: sync_strategy [forced_sync],
                               bucket_cap_mb [0.01], grad_dtype [float64],
                               buffer_sync [average]; also ``tp`` (it
                               becomes MMTensorParallelDDP)
``MMFullyShardedDataParallel`` ``fsdp1``: sync_strategy [multi_auto_sync],
                               sharding_strategy [HYBRID_SHARD],
                               hybrid_shard_size [2],
                               fsdp_auto_wrap_policy [module_class],
                               backward_prefetch [post], mixed_precision
                               [bf16/fp32/fp32], activation_checkpointing
                               (the wrapper spelling), sync_module_states,
                               buffer_sync [average], use_orig_params,
                               limit_all_gathers, forward_prefetch;
                               cpu_offload, device_id exempt (CUDA);
                               ignored_modules exempt (module objects)
``MMFullyShard``               ``fsdp2``: sync_strategy [multi_auto_sync],
                               sharding_strategy [HYBRID_SHARD],
                               hybrid_shard_size [2: one shard group of 2,
                               so it runs as FULL_SHARD],
                               reshard_after_forward [False],
                               fsdp_auto_wrap_policy [size_based],
                               mixed_precision [bf16/fp32, output_dtype bf16,
                               cast_forward_inputs], cpu_offload [True],
                               activation_checkpointing, buffer_sync [None]
activation_checkpointing       ``ddp`` [module_classes, every=2], ``bucket``
                               [a class name], ``use_fsdp`` [mode=selective,
                               save_ops]
model_compile                  ``naive`` [every key; backend eager]
============================== ============================================

Exempt everywhere: ``process_group`` / ``device_mesh`` / ``expert_mesh``
(runtime objects: compose hands each wrapper the layout's data (or expert)
axis; a config can only leave them None) and the CUDA-only values above.
"""
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from tests.e2e import ROOT, assert_same_training_state, load_ckpt, run_tool

BASE = ROOT / 'tests' / 'data' / 'options_vit.py'
ITERS = 4
NO_VAL = dict(val_cfg=None, val_dataloader=None, val_evaluator=None)
BLOCK = 'TransformerBlock'
FOUR_STAGES = ['blocks.1', 'blocks.2', 'blocks.3']
ACCUMULATE = dict(optim_wrapper=dict(accumulative_counts=2))
# ConvNeXt-V2's recipe (mmpretrain 1.2.0) plus a bias-lr and a custom-key
# rule; MMEngine's rules need a weight decay to scale.
PARAMWISE = dict(
    optimizer=dict(weight_decay=0.05),
    paramwise_cfg=dict(
        norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0,
        bias_lr_mult=2.0, custom_keys={'blocks.0.attn': dict(lr_mult=0.5)}))



def _pp_fsdp2(**pipeline) -> dict:
    return dict(
        parallel=dict(pp=2, pipeline=dict(schedule='1F1B',
                                          num_microbatches=2, **pipeline)),
        model_wrapper_cfg=dict(
            type='MMFullyShard',
            fsdp_auto_wrap_policy=dict(type='module_class',
                                       module_classes=[BLOCK])),
        **ACCUMULATE)


# Launches of wrapper and layout options: name -> config entries.
LAUNCHES = {
    'ddp': dict(
        parallel=dict(dp_replicate=2, dp_shard=1),
        model_wrapper_cfg=dict(
            type='MMDistributedDataParallel', sync_strategy='forced_sync',
            buffer_sync='average', bucket_cap_mb=1,
            find_unused_parameters=True, static_graph=False,
            broadcast_buffers=False, gradient_as_bucket_view=True),
        activation_checkpointing=dict(module_classes=[BLOCK], every=2),
        **ACCUMULATE),
    'naive': dict(
        model_wrapper_cfg=dict(
            type='MMNaiveDataParallel', sync_strategy='multi_auto_sync',
            bucket_cap_mb=1, buffer_sync=None),
        model_compile=dict(per_block=True, module_classes=[BLOCK],
                           backend='eager', mode=None, fullgraph=False,
                           dynamic=False, options=None),
        **ACCUMULATE),
    'bucket': dict(
        model_wrapper_cfg=dict(
            type='MMBucketDataParallel', sync_strategy='forced_sync',
            bucket_cap_mb=0.01, grad_dtype='float64', buffer_sync='average'),
        activation_checkpointing=BLOCK,
        **ACCUMULATE),
    'fsdp1': dict(
        model_wrapper_cfg=dict(
            type='MMFullyShardedDataParallel',
            sync_strategy='multi_auto_sync',
            sharding_strategy='HYBRID_SHARD', hybrid_shard_size=2,
            fsdp_auto_wrap_policy=dict(type='module_class',
                                       module_classes=[BLOCK]),
            backward_prefetch='post',
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32',
                                 buffer_dtype='fp32'),
            activation_checkpointing=[BLOCK], sync_module_states=True,
            buffer_sync='average', use_orig_params=True,
            limit_all_gathers=True, forward_prefetch=True),
        # A downstream project's optim wrapper (MMEngine's registry): the
        # wrapper adopts it, and its own step runs (STEP_MARKERS).
        custom_imports=dict(imports=['tests.data.downstream_optim'],
                            allow_failed_imports=False),
        optim_wrapper=dict(type='DownstreamOptimWrapper',
                           accumulative_counts=2)),
    'fsdp2': dict(
        model_wrapper_cfg=dict(
            type='MMFullyShard', sync_strategy='multi_auto_sync',
            sharding_strategy='HYBRID_SHARD', hybrid_shard_size=2,
            reshard_after_forward=False,
            fsdp_auto_wrap_policy=dict(type='size_based',
                                       min_num_params=1000),
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32',
                                 output_dtype='bf16',
                                 cast_forward_inputs=True),
            cpu_offload=True, activation_checkpointing=[BLOCK],
            buffer_sync=None),
        **ACCUMULATE),
    'use_fsdp': dict(
        parallel=dict(use_fsdp=True, sharding_strategy='SHARD_GRAD_OP',
                      sync_module_states=True, dp_shard=2),
        activation_checkpointing=dict(module_classes=[BLOCK],
                                      mode='selective',
                                      save_ops=['aten.max.default']),
        # FSDP1's parameters are 1-D views and checkpointing puts wrapper
        # prefixes into the names: the rules must still see the plain model.
        optim_wrapper=PARAMWISE),
    # pp=2 x FSDP2 over dp_shard=2 (4 processes, NPROC), each block its own
    # unit: mmpar's stage (resharding after every micro-batch), and torch's
    # schedule behaviour.
    'pp_fsdp2': _pp_fsdp2(reshard_per_microbatch=True),
    'pp_fsdp2_held': _pp_fsdp2(reshard_per_microbatch=False),
    # A model with timm's fused qkv, split part by part.
    'tp': dict(
        custom_imports=dict(imports=['examples.my_pkg.tp_vit'],
                            allow_failed_imports=False),
        model=dict(type='SplittableViT', fused_qkv=True),
        parallel=dict(
            tp=2, model_parallelism=2,
            tp_plan=dict(type='module_plan', plan={
                'blocks.*.attn': 'prepare_input',
                'blocks.*.attn.qkv': dict(style='colwise', fused=3),
                'blocks.*.attn.proj': 'rowwise',
                'blocks.*.mlp.fc1': 'colwise',
                'blocks.*.mlp.fc2': 'rowwise'})),
        model_wrapper_cfg=dict(type='MMBucketDataParallel', bucket_cap_mb=1,
                               sync_strategy='multi_auto_sync')),
}


# Lines a launch's own code prints, and how often (every rank's together).
STEP_MARKERS = {'fsdp1': ('DownstreamOptimWrapper.step', 2 * ITERS // 2)}

# Launches on more than 2 processes.
NPROC = {'pp_fsdp2': 4, 'pp_fsdp2_held': 4}


def _pipeline(schedule, num_microbatches=4, **pipeline):
    return dict(parallel=dict(pp=2, pipeline=dict(
        schedule=schedule, num_microbatches=num_microbatches, **pipeline)))


# One launch per registered schedule (test_every_registered_schedule_...),
# but 1F1B: tests/parallelize/test_pp_end_to_end.py trains, tests, resumes
# the example config that names it through the tools.
SCHEDULES_ELSEWHERE = {'1F1B': 'tests.parallelize.test_pp_end_to_end'}
SCHEDULES = {
    'GPipe': dict(parallel=dict(
        pp=2, pipeline_parallelism=2,
        pipeline=dict(schedule='GPipe', num_microbatches=2,
                      split_points=['blocks.2'], stages_per_rank=1))),
    'Interleaved1F1B': _pipeline('Interleaved1F1B', split_points=FOUR_STAGES,
                                 stages_per_rank=2),
    'LoopedBFS': _pipeline('LoopedBFS', stages_per_rank=2),
    'InterleavedZeroBubble': _pipeline('InterleavedZeroBubble',
                                       stages_per_rank=2),
    # V schedules cannot validate in torch 2.13 (docs/pipeline_parallel.md).
    'ZBVZeroBubble': dict(_pipeline('ZBVZeroBubble', stages_per_rank=2),
                          **NO_VAL),
    'DualPipeV': dict(_pipeline('DualPipeV', stages_per_rank=2), **NO_VAL),
}
RESUMED_SCHEDULE = 'Interleaved1F1B'
# fp32 on CPU, SGD: micro-batches and stages change only the summation
# order (the pipeline parity tests hold 1e-6 / 1e-5 over 4 steps).
ATOL, RTOL = 1e-6, 1e-5

# Documented keys no launch can meaningfully set, with the reason.
RUNTIME_OBJECT = ('a runtime object: compose hands the wrapper the layout\'s '
                  'data axis; a config can only leave it None')
CUDA_ONLY = 'CUDA only: tests/gpu/test_cuda_paths.py runs it on a GPU'
EXEMPT = {
    **{(wrapper, 'process_group'): RUNTIME_OBJECT for wrapper in (
        'MMDistributedDataParallel', 'MMNaiveDataParallel',
        'MMBucketDataParallel', 'MMFullyShardedDataParallel')},
    ('MMFullyShardedDataParallel', 'device_mesh'): RUNTIME_OBJECT,
    ('MMFullyShard', 'device_mesh'): RUNTIME_OBJECT,
    ('MMFullyShard', 'expert_mesh'): RUNTIME_OBJECT.replace(
        "data axis", "expert axis"),
    ('MMDistributedDataParallel', 'device_ids'):
        'CUDA device ids: DDP refuses them for CPU modules',
    ('MMFullyShardedDataParallel', 'device_id'):
        'a CUDA device; on CPU the only value is the default (CPU)',
    ('MMFullyShardedDataParallel', 'cpu_offload'): CUDA_ONLY,
    ('parallel', 'cpu_offload'): CUDA_ONLY + " (it is FSDP1's cpu_offload)",
    ('parallel', 'cp'): ('the options ViT has no context-parallel attention: '
                         'tests/tools/test_cp_end_to_end.py launches '
                         'parallel.cp=2 through dist_train.sh on the Llama'),
    ('parallel', 'ep'): ('the options ViT has no experts: '
                         'tests/tools/test_ep_end_to_end.py launches '
                         'parallel.ep=2 through dist_train.sh on the MoE '
                         'Llama'),
    # Passed through to torch with its default: listed by the docs as an
    # example of "anything else", not an mmpar option.
    ('MMFullyShardedDataParallel', 'ignored_modules'):
        'a list of module objects, not config data',
}
WRAPPERS = ('MMDistributedDataParallel', 'MMNaiveDataParallel',
            'MMBucketDataParallel', 'MMFullyShardedDataParallel',
            'MMFullyShard')


# -------------------------------------------------- what the docs promise


def _section(doc: str, heading: str) -> str:
    """The text under the first heading that starts with ``heading``, up to
    the next heading of the same or a higher level."""
    text = (ROOT / 'docs' / doc).read_text()
    match = re.search(rf'^(#+) {re.escape(heading)}.*$', text, re.M)
    assert match, (doc, heading)
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf'^#{{1,{level}}} ', rest, re.M)
    return match.group(0) + '\n' + (rest[:end.start()] if end else rest)


def _table_keys(text: str) -> set:
    """First-column keys of the section's tables, the names a heading's
    signature gives defaults to, and the pass-through names listed in
    parentheses on an "any other" / "anything else" row."""
    keys = set(re.findall(r'^\| `(\w+)` \|', text, re.M))
    heading = text.splitlines()[0]
    keys |= set(re.findall(r'(\w+)=', heading))
    for row in re.findall(r'^\| any(?:thing| other).*$', text, re.M):
        for group in re.findall(r'\(([^)]*)\)', row):
            keys |= set(re.findall(r'`([a-z_]+)`', group))
    return keys - {'module'}


def _code_keys(text: str) -> set:
    block = re.search(r'```python\n(.*?)```', text, re.S).group(1)
    return set(re.findall(r'(\w+)=', block))


def _arguments(cls) -> set:
    return {
        name for name, param in inspect.signature(cls).parameters.items()
        if param.kind is param.POSITIONAL_OR_KEYWORD and name != 'module'
    }


def documented_options() -> dict:
    """``{section: keys}``: each wrapper's ``model_wrapper_cfg`` keys,
    ``parallel``, ``parallel.pipeline``, ``activation_checkpointing`` and
    ``model_compile``, from the docs and the code's own key lists."""
    from mmpar.parallel.config import ParallelConfig
    from mmpar.parallelize import activation, compile as compile_
    from mmpar.parallelize.pipeline.config import PipelineConfig
    from mmpar.registry import MODEL_WRAPPERS

    options = {wrapper: _arguments(MODEL_WRAPPERS.get(wrapper))
               for wrapper in WRAPPERS}
    options['MMDistributedDataParallel'] |= _table_keys(
        _section('wrappers.md', 'MMDistributedDataParallel'))
    for wrapper in ('MMNaiveDataParallel', 'MMBucketDataParallel'):
        options[wrapper] |= _table_keys(
            _section('wrappers/naive_bucket.md', f'`{wrapper}('))
    options['MMFullyShardedDataParallel'] |= _table_keys(
        _section('fsdp.md', '`MMFullyShardedDataParallel`'))
    options['MMFullyShard'] |= _table_keys(
        _section('fsdp.md', '`MMFullyShard`'))
    pipeline_keys = _code_keys(_section('pipeline_parallel.md', 'Config'))
    parallel_keys = _code_keys(
        _section('topology.md', 'The `parallel` config section'))
    parallel_keys |= set(re.findall(
        r'`(\w+)=k`', _section('topology.md', 'The seed names')))
    options['parallel'] = parallel_keys | {
        f.name for f in dataclasses.fields(ParallelConfig)}
    options['parallel.pipeline'] = (pipeline_keys - {'pp', 'pipeline'}) | {
        f.name for f in dataclasses.fields(PipelineConfig)}
    options['activation_checkpointing'] = set(activation.OWN_KEYS)
    options['model_compile'] = set(compile_.OWN_KEYS + compile_.TORCH_KEYS)
    return options


def launched_options() -> dict:
    """``{section: keys}`` set by the launches of this module."""
    launched = {}
    for entries in list(LAUNCHES.values()) + list(SCHEDULES.values()):
        wrapper_cfg = entries.get('model_wrapper_cfg')
        if wrapper_cfg is not None:
            launched.setdefault(wrapper_cfg['type'], set()).update(
                set(wrapper_cfg) - {'type'})
        parallel = entries.get('parallel', {})
        launched.setdefault('parallel', set()).update(parallel)
        launched.setdefault('parallel.pipeline', set()).update(
            parallel.get('pipeline', {}))
        for key in ('activation_checkpointing', 'model_compile'):
            value = entries.get(key)
            if isinstance(value, dict):
                launched.setdefault(key, set()).update(value)
            elif value is not None:  # class names: module_classes
                launched.setdefault(key, set()).add('module_classes')
    return launched


def test_every_documented_option_is_launched():
    documented, launched = documented_options(), launched_options()
    missing = sorted(
        (section, key) for section, keys in documented.items()
        for key in keys - launched.get(section, set())
        if (section, key) not in EXEMPT)
    assert missing == [], (
        'documented options that no launch of tests/tools/'
        f'test_documented_options.py sets (add them to a launch): {missing}')
    # Exemptions name documented keys only (none left over).
    assert all(key in documented[section] for section, key in EXEMPT)


def test_every_registered_schedule_is_launched():
    import importlib

    import mmpar.parallelize.pipeline.schedules  # noqa: F401 (registers)
    from mmpar.registry import PIPELINE_SCHEDULES
    registered = set(PIPELINE_SCHEDULES.module_dict)
    launched = {entries['parallel']['pipeline']['schedule']
                for entries in SCHEDULES.values()}
    assert launched == set(SCHEDULES)
    for schedule, module in SCHEDULES_ELSEWHERE.items():
        config = importlib.import_module(module).CONFIG
        parallel = Config.fromfile(str(ROOT / config)).parallel
        assert parallel['pipeline']['schedule'] == schedule, module
        launched.add(schedule)
    assert registered == launched


# ------------------------------------------------------------- launches


def write_config(path: Path, entries: dict) -> Path:
    lines = [f"_base_ = ['{BASE}']"]
    lines += [f'{key} = {value!r}' for key, value in entries.items()]
    path.write_text('\n'.join(lines) + '\n')
    return path


def dist_train(config: Path, work_dir: Path, *args, nproc=2):
    """``tools/dist_train.sh``; fails on a non-zero exit."""
    proc = run_tool(['bash', 'tools/dist_train.sh', config, nproc,
                     '--work-dir', work_dir, *args], timeout=300, check=False)
    if proc.returncode != 0:
        raise AssertionError(f'dist_train.sh {config} exited '
                             f'{proc.returncode}\n'
                             f'{(proc.stdout + proc.stderr)[-6000:]}')
    return proc


def _contains(actual, expected) -> bool:
    """Every key of ``expected`` is in ``actual`` with its value."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and _contains(actual[key], value)
            for key, value in expected.items())
    if isinstance(expected, (list, tuple)):
        return list(actual) == list(expected)
    return actual == expected


def logged(log: str, key: str) -> list:
    """``key``'s value on each training iteration's log line."""
    return [float(x) for x in re.findall(
        rf'Iter\(train\) \[\s*\d+/{ITERS}\].*? {key}: ([\d.naif]+)', log)]


def _assert_trained_with(work_dir: Path, name: str, entries: dict, proc):
    """The run saw ``entries`` (MMEngine dumps the config it ran with into
    the work dir) and trained every iteration to a finite loss."""
    ran = Config.fromfile(str(work_dir / f'{name}.py')).to_dict()
    for key, value in entries.items():
        assert _contains(ran.get(key), value), (name, key, ran.get(key))
    log = proc.stdout + proc.stderr
    losses = logged(log, 'loss')
    assert len(losses) == ITERS and all(
        torch.isfinite(torch.tensor(losses))), log[-3000:]
    assert (work_dir / f'iter_{ITERS}.pth').is_file()


@pytest.mark.parametrize('name', list(LAUNCHES))
def test_options_train_through_dist_train(name, tmp_path):
    entries = LAUNCHES[name]
    config = write_config(tmp_path / f'{name}.py', entries)
    proc = dist_train(config, tmp_path / 'work', nproc=NPROC.get(name, 2))
    _assert_trained_with(tmp_path / 'work', name, entries, proc)
    if name in STEP_MARKERS:
        marker, count = STEP_MARKERS[name]
        assert (proc.stdout + proc.stderr).count(marker) == count
    if 'paramwise_cfg' in entries.get('optim_wrapper', {}):
        _assert_one_process_groups(config, tmp_path / 'work')


def _assert_one_process_groups(config: Path, work_dir: Path):
    """The checkpoint's optimizer groups (listing parameter names) give
    each parameter the lr and weight decay MMEngine's constructor gives it
    on the plain model in one process."""
    from mmengine.optim import build_optim_wrapper
    from mmpar.models import DigitsViT
    cfg = Config.fromfile(str(config))
    model = DigitsViT(**{k: v for k, v in cfg.model.items() if k != 'type'})
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {
        names[id(p)]: (g['lr'], g['weight_decay'])
        for g in build_optim_wrapper(model, cfg.optim_wrapper)
        .optimizer.param_groups for p in g['params']}
    groups = load_ckpt(work_dir / f'iter_{ITERS}.pth')['optimizer'][
        'param_groups']
    saved = {n: (g['initial_lr'], g['weight_decay'])
             for g in groups for n in g['params']}
    assert saved == expected
    assert len(set(expected.values())) == 4  # the rules matter here


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
    """The base config on one process, unwrapped (what ``tools/train.py``
    runs, here in this process to spare a start-up): the weights every
    schedule must reach (the same global batch: pp peers read one batch)."""
    from mmpar.runner import Runner
    work_dir = tmp_path_factory.mktemp('one_process')
    cfg = Config.fromfile(str(BASE))
    cfg.work_dir = str(work_dir)
    cfg.experiment_name = 'options_one_process'
    Runner.from_cfg(cfg).train()
    log = next(work_dir.glob('*/*.log')).read_text()
    return (load_ckpt(work_dir / f'iter_{ITERS}.pth')['state_dict'],
            {key: logged(log, key) for key in ('loss', 'grad_norm')})


@pytest.fixture(scope='module')
def schedule_run(tmp_path_factory):
    """``schedule_run(name)``: the work dir of the schedule's launch,
    trained on first use. Read-only: a resume writes into its own dir."""
    done = {}

    def get(schedule):
        if schedule not in done:
            root = tmp_path_factory.mktemp(f'pp_{schedule}')
            name = f'pp_{schedule}'
            config = write_config(root / f'{name}.py', SCHEDULES[schedule])
            proc = dist_train(config, root / 'work')
            _assert_trained_with(root / 'work', name, SCHEDULES[schedule],
                                 proc)
            done[schedule] = root / 'work', config, proc.stdout + proc.stderr
        return done[schedule]

    return get


# (Every schedule: with several stages per rank the Runner's optimizer once
# held one local stage, MMEngine's constructor taking the wrapper's
# ``module``; mmpar.runner.optim.every_stage hands it all of them.)
@pytest.mark.parametrize('schedule', list(SCHEDULES))
def test_schedule_trains_through_dist_train_like_one_process(
        schedule, schedule_run, one_process):
    work_dir, _, log = schedule_run(schedule)
    expected_state, expected_log = one_process
    # The logged loss and global gradient norm of every iteration (printed
    # to 4 decimals): a gradient scaled wrongly shows here even though the
    # active clip would hide it from the weights.
    for key, values in expected_log.items():
        assert logged(log, key) == pytest.approx(values, abs=2e-4), key
    state = load_ckpt(work_dir / f'iter_{ITERS}.pth')['state_dict']
    assert state.keys() == expected_state.keys()  # every stage, plain names
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, key=key: f'{key}: {m}')


def test_virtual_stage_schedule_resumes_through_dist_train(schedule_run,
                                                          tmp_path):
    """Train (the straight launch), save at iteration 2, ``--resume`` from
    it in another work dir: iteration 4 equals the straight run's, weights
    and every stage's optimizer state, bit for bit."""
    straight, config, _ = schedule_run(RESUMED_SCHEDULE)
    resumed = tmp_path / 'resumed'
    proc = dist_train(config, resumed, '--resume', straight / 'iter_2.pth')
    assert 'resumed epoch: 0, iter: 2' in proc.stdout + proc.stderr
    assert not (resumed / 'iter_2.pth').exists()  # resumed, not retrained
    assert_same_training_state(load_ckpt(resumed / f'iter_{ITERS}.pth'),
                               load_ckpt(straight / f'iter_{ITERS}.pth'))
