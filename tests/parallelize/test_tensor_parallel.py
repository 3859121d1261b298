"""Tensor parallelism: plans, start-up errors, and parity with one process.

Every parity case trains the tiny digits ViT for 3 SGD steps of 2
accumulated micro-batches with clipping by the global norm active, on the
same global batches as a one-process reference, and compares the gathered
full state dict's parameter updates and the clip's total norms (see
tests/parallelize/tp_cases.py).
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mmpar.parallelize.module_plan import match_modules, module_plan_styles
from mmpar.parallelize.tensor import (apply_tp, check_tp_plan,
                                      registered_plans)
from mmpar.parallelize.tp_wrapper import data_parallel_cfg_for_tp
from mmpar.wrappers.fully_shard import MMFullyShard
from mmpar.wrappers.tp_replicate import MMTensorParallelDDP
from tests.parallelize import tp_cases

VIT_PLAN = {'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.3': 'rowwise'}


# -- start-up checks (no process group) -------------------------------------
def test_registered_plans_include_builtins():
    assert {'module_plan', 'digits_vit'} <= set(registered_plans())


def test_unknown_plan_name_lists_registered():
    with pytest.raises(ValueError, match=r"tp_plan='nope'.*module_plan"):
        check_tp_plan('nope')


def test_unknown_style_named():
    with pytest.raises(ValueError, match=r"'blocks.\*.mlp.0'.*'diagonal'"):
        check_tp_plan(
            dict(type='module_plan', plan={'blocks.*.mlp.0': 'diagonal'}))


def test_bad_layout_named():
    plan = {'a': dict(style='colwise', output_layouts='shard(x)')}
    with pytest.raises(ValueError, match=r"output_layouts='shard\(x\)'"):
        check_tp_plan(dict(type='module_plan', plan=plan))


def test_pattern_matching_nothing_lists_modules():
    with pytest.raises(ValueError, match=r"'blocks.\*.ffn.0'.*blocks.0.mlp"):
        module_plan_styles(tp_cases.make_vit(), {'blocks.*.ffn.0': 'colwise'},
                           2)


def test_tp_not_dividing_split_dim_names_module_and_sizes():
    with pytest.raises(ValueError,
                       match=r"tp=3.*'blocks.0.mlp.0'.*size 32"):
        module_plan_styles(tp_cases.make_vit(), VIT_PLAN, 3)


def test_style_on_unsplittable_module():
    with pytest.raises(ValueError, match=r"'blocks.0.attn'.*MultiheadAtt"):
        module_plan_styles(tp_cases.make_vit(), {'blocks.*.attn': 'colwise'},
                           2)


@pytest.mark.parametrize('entry,named', [
    # A key another style takes.
    (dict(style='colwise', desired_input_layouts='replicate'),
     r"desired_input_layouts='replicate': style 'colwise' takes no "
     r"desired_input_layouts; allowed: input_layouts, output_layouts"),
    (dict(style='prepare_input', output_layouts='replicate'),
     r"style 'prepare_input' takes no output_layouts; allowed: input_layouts,"
     r" desired_input_layouts, use_local_output"),
    (dict(style='sequence_parallel', input_layouts='shard(1)'),
     r"style 'sequence_parallel' takes no input_layouts; allowed: "
     r"use_local_output"),
    (dict(style='prepare_input', input_layouts=['shard(1)', 'shard(x)']),
     r"\['a'\].input_layouts\[1\]='shard\(x\)' is not a layout"),
    (dict(style='prepare_input', input_layouts=['shard(1)', None],
          desired_input_layouts=['replicate']),
     r"input_layouts=\['shard\(1\)', None\] and desired_input_layouts="
     r"\['replicate'\] have different lengths"),
    (dict(style='prepare_input', input_layouts=['shard(1)', None],
          desired_input_layouts=['replicate', 'replicate']),
     r"argument 1 has input layout None and desired layout Replicate\(\); "
     r"allowed: both layouts, or both None"),
    (dict(style='prepare_input', input_layouts=[None]),
     r"every argument is left alone \(None\); allowed: a layout"),
    (dict(style='prepare_input', use_local_output='yes'),
     r"use_local_output='yes' is not allowed; allowed: True or False"),
])
def test_bad_entry_named_with_allowed_values(entry, named):
    with pytest.raises(ValueError, match=named):
        check_tp_plan(dict(type='module_plan', plan={'a': entry}))


def test_prepare_input_layout_past_forward_parameters():
    """A layout for an argument forward does not take fails at start-up
    (the ViT's attention takes x only)."""
    from examples.my_pkg.tp_vit import TP_PLAN
    plan = dict(TP_PLAN, **{'blocks.*.attn': dict(
        style='prepare_input', input_layouts=['replicate', 'replicate'])})
    with pytest.raises(ValueError,
                       match=r"'blocks.0.attn' \(SplittableAttention\) "
                       r"prepare_input has a layout for positional argument "
                       r"1, but its forward takes 1 \(x\)"):
        module_plan_styles(tp_cases.make_splittable_vit(), plan, 2)


def test_prepare_input_refuses_a_non_tensor_argument(tp_mesh_1):
    from torch import nn
    from torch.distributed.tensor import Replicate

    from mmpar.parallelize.tp_styles import PrepareInput

    class TakesScale(nn.Module):

        def forward(self, x, scale):
            return x * scale

    module = PrepareInput(input_layouts=(Replicate(), Replicate()),
                          desired_input_layouts=(Replicate(), Replicate())
                          )._apply(TakesScale(), tp_mesh_1)
    with pytest.raises(ValueError, match=r"TakesScale argument 'scale' is a "
                       r"float, not a tensor; give it the layout None"):
        module(torch.ones(2), scale=2.0)


@pytest.fixture
def tp_mesh_1():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=1)
    return init_device_mesh('cpu', (1, ))


def test_patterns_match_per_part():
    model = tp_cases.make_vit()
    assert match_modules(model, 'blocks.*.mlp.0') == [
        'blocks.0.mlp.0', 'blocks.1.mlp.0'
    ]
    assert match_modules(model, '*.0') == ['blocks.0']  # not blocks.0.mlp.0
    assert match_modules(model, 'mlp.0') == []


# -- parity (multi-process) ---------------------------------------------------
WRAPPERS = dict(
    ddp=lambda m, mesh, **kw: MMTensorParallelDDP(
        m, process_group=mesh['dp'].get_group(), bucket_cap_mb=0.001, **kw),
    fsdp2=lambda m, mesh, **kw: MMFullyShard(m, device_mesh=mesh['dp'], **kw),
)
# bf16 autocast (8 bits of mantissa): the split matmuls round differently
# from the whole ones; a missing reduction would still be off by O(1).
AMP_TOLERANCE = dict(rtol=2e-2, atol=2e-4, norm_rtol=1e-2)


def _parity(wrapper_name: str, tp: int, plan, model_name='vit', amp=False,
            **wrapper_kwargs):
    mesh = tp_cases.world_mesh(tp)
    model = tp_cases.MODELS[model_name]()
    initial = tp_cases.full_state(model)
    expected = tp_cases.reference_state(model, amp)
    apply_tp(model, mesh['tp'], plan)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    assert split and all(('mlp' in n or 'attn' in n or 'norm' in n)
                         for n in split), split
    wrapper = WRAPPERS[wrapper_name](model, mesh, **wrapper_kwargs)
    dp_rank, dp = mesh['dp'].get_local_rank(), mesh['dp'].size()
    actual = tp_cases.train_layout(wrapper, dp_rank, dp, amp)
    tp_cases.assert_parity(actual, expected, initial,
                           **(AMP_TOLERANCE if amp else {}))
    # The gathered state is the plain model's: it loads strictly.
    tp_cases.MODELS[model_name]().load_state_dict(actual[0], strict=True)
    return dist.get_rank()


def test_tp2_parity(run_dist):
    assert run_dist(_parity, 'ddp', 2, 'digits_vit') == [0, 1]


def test_tp2_module_plan_parity(run_dist):
    plan = dict(type='module_plan', plan=VIT_PLAN)
    assert run_dist(_parity, 'fsdp2', 2, plan) == [0, 1]


def test_tp2_x_fsdp2_dp2_parity(run_dist):
    assert run_dist(_parity, 'fsdp2', 2, 'digits_vit',
                    world_size=4) == [0, 1, 2, 3]


def test_tp2_x_ddp_dp2_parity(run_dist):
    assert run_dist(_parity, 'ddp', 2, 'digits_vit',
                    world_size=4) == [0, 1, 2, 3]


def test_user_model_module_plan_parity(run_dist):
    """A model from outside mmpar, attention split too, plan as data."""
    from examples.my_pkg.tp_vit import TP_PLAN
    plan = dict(type='module_plan', plan=TP_PLAN)
    assert run_dist(_parity, 'ddp', 2, plan, 'splittable',
                    world_size=4) == [0, 1, 2, 3]


@pytest.mark.parametrize('sync_strategy', ['multi_auto_sync', 'forced_sync'])
def test_tp2_x_ddp_dp2_sync_strategies(run_dist, sync_strategy):
    assert run_dist(_parity, 'ddp', 2, 'digits_vit', world_size=4,
                    sync_strategy=sync_strategy) == [0, 1, 2, 3]


@pytest.mark.parametrize('wrapper_name', ['ddp', 'fsdp2'])
def test_tp2_x_dp2_bf16_autocast(run_dist, wrapper_name):
    assert run_dist(_parity, wrapper_name, 2, 'digits_vit', world_size=4,
                    amp=True) == [0, 1, 2, 3]


def test_replicate_style_parity(run_dist):
    """Norms kept whole as replicated DTensors between split layers."""
    from examples.my_pkg.tp_vit import TP_PLAN
    plan = dict(TP_PLAN, **{'blocks.*.norm1': 'replicate',
                            'blocks.*.norm2': 'replicate'})
    assert run_dist(_parity, 'ddp', 2, dict(type='module_plan', plan=plan),
                    'splittable') == [0, 1]


def _clip_mixed_meshes():
    """The clip agrees with one process on mixed plain/DTensor gradients."""
    from mmpar.optim.clip import clip_grad_norm_
    mesh = tp_cases.world_mesh(2)
    model = tp_cases.make_vit()
    ref = tp_cases.make_vit()
    batch = tp_cases.make_image_batches(1)[0]
    ref(**batch, mode='loss')['loss'].backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    apply_tp(model, mesh['tp'], 'digits_vit')
    model(**batch, mode='loss')['loss'].backward()
    total = clip_grad_norm_(list(model.parameters()), 0.01)
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, atol=1e-7, rtol=1e-5,
                                   msg=name)
    inf = clip_grad_norm_(list(model.parameters()), 1.0, float('inf'))
    torch.testing.assert_close(
        inf, max(q.grad.abs().max() for q in ref.parameters()), rtol=1e-5,
        atol=1e-8)


def test_clip_mixed_tensor_and_dtensor(run_dist):
    run_dist(_clip_mixed_meshes)


# -- which data-parallel wrapper composes with TP -------------------------------
def test_ddp_becomes_tensor_parallel_ddp():
    assert data_parallel_cfg_for_tp(None, 2) == dict(type='MMTensorParallelDDP')
    cfg = dict(type='MMDistributedDataParallel', find_unused_parameters=True,
               sync_strategy='forced_sync')
    assert data_parallel_cfg_for_tp(cfg, 2) == dict(
        type='MMTensorParallelDDP', sync_strategy='forced_sync')
    assert cfg['type'] == 'MMDistributedDataParallel'  # not mutated
    assert data_parallel_cfg_for_tp(dict(type='MMFullyShard'), 2) == dict(
        type='MMFullyShard')


def test_fsdp1_with_tp_refused_naming_fully_shard():
    with pytest.raises(ValueError,
                       match=r"'MMFullyShardedDataParallel'.*tp=2.*"
                       r"MMFullyShard'"):
        data_parallel_cfg_for_tp(dict(type='MMFullyShardedDataParallel'), 2)


def test_naive_with_tp_refused():
    with pytest.raises(ValueError, match=r"'MMNaiveDataParallel'.*allowed"):
        data_parallel_cfg_for_tp(dict(type='MMNaiveDataParallel'), 2)


def _skip_nonfinite_window():
    """NonFiniteLossHook(action='skip') under tp=2 x DDP dp=2: a NaN on one
    data rank drops the window on every rank, as one process would."""
    from mmpar.runner import NonFiniteLossHook
    from tests.runner.test_nonfinite import _fake_runner
    mesh = tp_cases.world_mesh(2)
    model = tp_cases.make_vit()
    batches = tp_cases.make_image_batches()
    batches[1]['inputs'][0, 0, 0, 0] = float('nan')  # dp rank 0's slice
    reference = tp_cases.make_vit()
    ref_optim = tp_cases.optim_wrapper_for(reference)
    for batch in tp_cases.make_image_batches()[tp_cases.ACCUMULATE:]:
        reference.train_step(batch, ref_optim)
    apply_tp(model, mesh['tp'], 'digits_vit')
    wrapper = WRAPPERS['ddp'](model, mesh)
    optim_wrapper = tp_cases.optim_wrapper_for(model)
    hook = NonFiniteLossHook(action='skip')
    runner = _fake_runner(wrapper, optim_wrapper)
    hook.before_train(runner)
    dp_rank, dp = mesh['dp'].get_local_rank(), mesh['dp'].size()
    try:
        for batch in batches:
            wrapper.train_step(tp_cases.dp_slice(batch, dp_rank, dp),
                               optim_wrapper)
            runner.iter += 1
    finally:
        hook.after_train(runner)
    state = wrapper.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6,
                                   msg=key)


def test_nonfinite_skip_under_tp(run_dist):
    run_dist(_skip_nonfinite_window, world_size=4)
