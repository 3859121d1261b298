"""The plan tells the truth for every axis: at 8 fake ranks, with tp > 1 and
with dp_shard < dp, the groups each real wrapper reduces and shards over are
the layout's, and the per-rank counts are the real wrappers' shards."""
import itertools
from pathlib import Path

import pytest
import torch.distributed as dist
from mmengine.config import Config

from mmpar.analysis.fsdp_units import PlanError
from mmpar.analysis.plan import make_plan
from mmpar.analysis.plan_report import format_plan
from mmpar.parallel import AXES
from mmpar.registry import MODELS
from tests.data.plan_model import PlanToyNet

DATA = Path(__file__).resolve().parents[1] / 'data'
POLICY = dict(type='module_class', module_classes=['PlanBlock'])
WRAPPERS = {
    'ddp': dict(type='MMDistributedDataParallel'),
    'naive': dict(type='MMNaiveDataParallel'),
    'bucket': dict(type='MMBucketDataParallel'),
    'fsdp1': dict(type='MMFullyShardedDataParallel',
                  fsdp_auto_wrap_policy=POLICY),
    'fsdp2': dict(type='MMFullyShard', fsdp_auto_wrap_policy=POLICY),
}
TP_PLAN = dict(type='module_plan',
               plan={'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.2': 'rowwise'})
TP_LAYOUT = dict(dp_replicate=2, dp_shard=2, tp=2, tp_plan=TP_PLAN)
# With tp > 1 these wrappers are refused (docs/tensor_parallel.md).
REFUSED_WITH_TP = ('fsdp1', 'naive')
HSDP_LAYOUT = dict(dp_replicate=2, dp_shard=4)


def brute_force_group(shape, rank, axes):
    """Ranks sharing every coordinate of ``rank`` except those on ``axes``,
    by enumerating the (dp_replicate, dp_shard, pp, tp) grid."""
    coords = list(itertools.product(*(range(n) for n in shape)))
    fixed = [i for i, name in enumerate(AXES) if name not in axes]
    mine = coords[rank]
    return [r for r, c in enumerate(coords)
            if all(c[i] == mine[i] for i in fixed)]


def plan_for(wrapper, section, rank):
    cfg = Config.fromfile(str(DATA / 'plan_ddp.py'))
    cfg.model_wrapper_cfg = WRAPPERS[wrapper]
    cfg.parallel = section  # replaces plan_ddp.py's seed-named section
    return make_plan(cfg, 8, rank)


@pytest.mark.parametrize('section', [TP_LAYOUT, HSDP_LAYOUT],
                         ids=['tp2', 'dp_shard4_of_8'])
@pytest.mark.parametrize('wrapper', sorted(WRAPPERS))
@pytest.mark.parametrize('rank', [0, 5])
def test_wrapper_axes_are_the_layouts(wrapper, section, rank):
    if section is TP_LAYOUT and wrapper in REFUSED_WITH_TP:
        with pytest.raises(PlanError, match='parallel.tp=2'):
            plan_for(wrapper, section, rank)
        return
    plan = plan_for(wrapper, section, rank)
    shape = plan.dims.shape
    dp = brute_force_group(shape, rank, ('dp_replicate', 'dp_shard'))
    shard = brute_force_group(shape, rank, ('dp_shard', ))
    replicate = brute_force_group(shape, rank, ('dp_replicate', ))
    if wrapper.startswith('fsdp'):
        # The 2-D data layout makes FULL_SHARD HSDP in both FSDPs.
        assert plan.axes == {'shard': ('dp_shard', shard),
                             'replicate': ('dp_replicate', replicate)}
        assert plan.shard_size == len(shard) < len(dp)
    else:
        assert plan.axes == {'reduce': ('dp', dp)}
    # tp peers never average gradients with each other.
    tp = brute_force_group(shape, rank, ('tp', ))
    assert all(set(ranks) & set(tp) == {rank}
               for _, ranks in plan.axes.values())
    text = format_plan(plan)
    assert 'tp groups: ' in text and f'rank {rank}: tp {tp}' in text
    if section is TP_LAYOUT:
        assert any('tp=2' in n and 'split' in n for n in plan.notes)


def _real_local_numel(wrapper, model_cls=PlanToyNet):
    """Elements one rank holds under the real wrapper (fake group):
    ``(parameters, gradients)``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from mmpar.parallel import init_parallelism, reset_parallelism
    from mmpar.parallel.config import ParallelConfig
    from mmpar.wrappers import build_model_wrapper
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group('fake', store=FakeStore(), rank=5, world_size=8)
    try:
        from mmpar.parallelize.compose import data_axis_args
        dims = ParallelConfig.from_cfg(HSDP_LAYOUT).dims(8)
        topology = init_parallelism(dims=dims)
        # The data axis as compose hands it to the wrapper.
        built = build_model_wrapper(
            WRAPPERS[wrapper], model_cls(),
            default_args=data_axis_args(WRAPPERS[wrapper], topology))
        if wrapper == 'fsdp1':  # a flat parameter gets a gradient whole
            flat = [m._flat_param for m in FSDP.fsdp_modules(built)]
        else:
            flat = [p.to_local() for p in built.parameters()]
        return (sum(p.numel() for p in flat),
                sum(p.numel() for p in flat if p.requires_grad))
    finally:
        reset_parallelism()
        dist.destroy_process_group()


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2'])
def test_per_rank_params_are_the_real_shards(wrapper):
    plan = plan_for(wrapper, HSDP_LAYOUT, 5)
    name, count, num_bytes = plan.memory[0]
    assert name == 'params'
    assert count == _real_local_numel(wrapper)[0]
    assert num_bytes == 4 * count
    # Sharded over 4 of 8 ranks: a quarter (plus padding), not an eighth.
    assert plan.param_numel / 4 <= count < plan.param_numel / 4 + 64


def test_replicating_wrappers_hold_everything():
    plan = plan_for('ddp', HSDP_LAYOUT, 3)
    assert plan.memory[0][1] == plan.param_numel
    assert plan.memory[2] == ('optimizer state (SGD: 1 x params)',
                              plan.param_numel, 4 * plan.param_numel)


@MODELS.register_module()
class FrozenPlanToyNet(PlanToyNet):
    """PlanToyNet fine-tuned: everything but the head frozen."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for name, param in self.named_parameters():
            param.requires_grad_(name.startswith('head.'))


def frozen_plan_for(wrapper, rank):
    cfg = Config.fromfile(str(DATA / 'plan_ddp.py'))
    cfg.model = dict(type='FrozenPlanToyNet')
    cfg.model_wrapper_cfg = WRAPPERS[wrapper]
    cfg.parallel = HSDP_LAYOUT
    return make_plan(cfg, 8, rank)


def test_frozen_parameters_are_held_but_get_no_grads_or_state():
    """A frozen backbone is memory every rank holds (and builds), but it
    gets no gradient and no optimizer state; the plan counted only the
    trainable parameters for all three."""
    model = FrozenPlanToyNet()
    total = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in model.head.parameters())
    plan = frozen_plan_for('ddp', 3)
    assert plan.memory == [
        ('params', total, 4 * total), ('grads', head, 4 * head),
        ('optimizer state (SGD: 1 x params)', head, 4 * head)]
    est = plan.estimate
    assert (est.params, est.grads, est.optimizer) == \
        (4 * total, 4 * head, 4 * head)
    assert not est.meta_init and est.build == 2 * 4 * total  # + its copy
    assert (plan.param_numel, plan.trainable_numel) == (total, head)
    assert f'{total:,} params ({head:,} trainable)' in format_plan(plan)


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2'])
def test_frozen_parameters_are_sharded_but_get_no_grads_under_fsdp(wrapper):
    """Sharded whole; gradients and optimizer state as the real wrappers
    keep them: FSDP2 per trainable parameter, FSDP1 per flat parameter
    with any trainable parameter in it (the root: embed and head)."""
    plan = frozen_plan_for(wrapper, 5)
    held, trained = _real_local_numel(wrapper, FrozenPlanToyNet)
    assert plan.memory[0] == ('params', held, 4 * held)
    assert plan.memory[1] == ('grads', trained, 4 * trained)
    assert plan.memory[2][1] == trained  # SGD's momentum
    assert 0 < trained < held / 10
    # The largest unit gathered is a frozen block: its parameters only.
    block = sum(p.numel() for p in PlanToyNet().blocks[0].parameters())
    assert plan.estimate.gathered_unit == 4 * block


def test_tensor_parallel_counts_are_the_local_shards():
    """tp=2 halves the split Linears (the rowwise bias stays whole)."""
    model = PlanToyNet()
    split = sum(
        block.mlp[0].weight.numel() + block.mlp[0].bias.numel() +
        block.mlp[2].weight.numel() for block in model.blocks)
    plan = plan_for('ddp', TP_LAYOUT, 3)
    assert plan.wrapper_type == 'MMTensorParallelDDP'
    assert plan.memory[0][1] == plan.param_numel - split // 2
    fsdp2 = plan_for('fsdp2', TP_LAYOUT, 3)
    # Split over tp=2, then sharded over dp_shard=2 (plus padding).
    assert fsdp2.memory[0][1] < plan.memory[0][1] / 2 + 64


def test_refused_layout_fails_the_plan_too():
    from mmpar.analysis.plan import PlanError
    with pytest.raises(PlanError, match='parallel.tp=2 asks for tensor'):
        plan_for('ddp', dict(tp=2), 0)
    assert not dist.is_initialized()


@pytest.mark.parametrize('rank,held', [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_pipeline_stages_and_bubble(rank, held):
    # The digits ViT cut at blocks.2 into 2 stages (pp=2 x dp=2 on 4 ranks).
    root = Path(__file__).resolve().parents[2]
    cfg = Config.fromfile(str(root / 'configs/vit_digits/vit_digits_pp.py'))
    plan = make_plan(cfg, 4, rank)
    from mmpar.models import DigitsViT
    from mmpar.parallelize.pipeline.split import split_stage, stage_starts
    model = DigitsViT(**{k: v for k, v in cfg.model.items() if k != 'type'})
    starts = stage_starts(model, ['blocks.2'], 2)
    numels = [sum(p.numel() for p in split_stage(model, starts, s)
                  .parameters()) for s in (0, 1)]
    text = format_plan(plan)
    assert f'pp stage 0: blocks.0 .. blocks.1, {numels[0]:,} parameters' \
        in text
    assert f'pp stage 1: blocks.2 .. blocks.3, {numels[1]:,} parameters' \
        in text
    assert f'this rank holds pp stage(s) [{held}]: {numels[held]:,} ' \
        'parameters' in text
    # 1F1B, p=2, m=4: (p-1)/(m+p-1) = 1/5.
    assert 'theoretical bubble of GPipe/1F1B (p-1)/(m+p-1) = 0.200' in text


@pytest.mark.parametrize('rank,held', [(0, 0), (6, 1)])
def test_pipeline_with_tensor_parallel_at_8(rank, held):
    # 3-D: pp=2 x tp=2 x FSDP2 dp_shard=2 (the Llama pp_tp config): the
    # stages are cut from the tp-split model, this rank holds its shards.
    root = Path(__file__).resolve().parents[2]
    cfg = Config.fromfile(
        str(root / 'configs/llama_shakespeare/llama_shakespeare_pp_tp.py'))
    cfg.merge_from_dict({'model.dim': 32, 'model.num_layers': 2,
                         'model.num_heads': 2})
    plan = make_plan(cfg, 8, rank)
    assert plan.dims.shape == (1, 2, 1, 2, 1, 2)
    assert plan.wrapper_type == 'MMFullyShard'
    # FSDP2 shards over the data axis: ranks at the same (pp, tp).
    assert plan.axes['shard'] == ('dp', brute_force_group(
        plan.dims.shape, rank, ('dp_replicate', 'dp_shard')))
    text = format_plan(plan)
    assert 'pp groups: [0, 2] [1, 3] [4, 6] [5, 7]' in text
    from mmpar.models.llama import Llama
    model = Llama(**{k: v for k, v in cfg.model.items() if k != 'type'})
    # Stage 0: the embedding and block 0; stage 1: block 1, norm, output.
    # tp=2 halves every projection and the embedding; the norms stay whole.
    owner = ('tok_embeddings', 'layers.0') if held == 0 else \
        ('layers.1', 'norm', 'output')
    params = {n: p for n, p in model.named_parameters()
              if n.startswith(owner)}
    numel = sum(p.numel() for p in params.values())
    local = sum(p.numel() // (1 if 'norm' in n else 2)
                for n, p in params.items())
    assert f'this rank holds pp stage(s) [{held}]: {numel:,} parameters; ' \
        f'its tp=2 shards: {local:,} elements ({4 * local:,} bytes' in text


def _pp_plan(world_size, rank, **options):
    root = Path(__file__).resolve().parents[2]
    cfg = Config.fromfile(str(root / 'configs/vit_digits/vit_digits_pp.py'))
    cfg.merge_from_dict(options)
    return make_plan(cfg, world_size, rank)


def _stage_numels(plan, num_stages):
    # The plan's own per-stage notes, checked against split_stage above.
    notes = [n for n in plan.notes if n.startswith('pp stage ')]
    assert len(notes) == num_stages
    return [int(n.rsplit(', ', 1)[1].split()[0].replace(',', ''))
            for n in notes]


@pytest.mark.parametrize('schedule,stages_of_rank', [
    ('1F1B', [[0], [1]]),
    ('Interleaved1F1B', [[0, 2], [1, 3]]),
    ('ZBVZeroBubble', [[0, 3], [1, 2]]),
])
def test_pipeline_memory_counts_only_this_ranks_stages(schedule,
                                                       stages_of_rank):
    """pp=2 on 2 ranks: each rank's params, grads and AdamW state are those
    of its own stages, and the ranks' params add up to the whole model."""
    v = len(stages_of_rank[0])
    pipeline = dict(schedule=schedule, stages_per_rank=v,
                    split_points=None if v > 1 else ['blocks.2'])
    # ZBVZeroBubble cannot validate in torch 2.13: train without it.
    no_val = dict(val_dataloader=None, val_cfg=None, val_evaluator=None) \
        if schedule == 'ZBVZeroBubble' else {}
    plans = [_pp_plan(2, rank, parallel=dict(pipeline=pipeline), **no_val)
             for rank in (0, 1)]
    numels = _stage_numels(plans[0], 2 * v)
    assert sum(numels) == plans[0].param_numel
    for plan, stages in zip(plans, stages_of_rank):
        held = sum(numels[s] for s in stages)
        assert plan.pp_stages == stages
        assert plan.memory == [
            ('params', held, 4 * held), ('grads', held, 4 * held),
            ('optimizer state (AdamW: 2 x params)', 2 * held, 8 * held)]
        assert f'this rank: pp stage(s) {stages}' in format_plan(plan)
    assert sum(p.memory[0][2] for p in plans) == 4 * plans[0].param_numel
    if v > 1:  # p=2, m=4, v=2: (p-1)/(v*m+p-1) = 1/9
        bound = '<= ' if 'Zero' in schedule else ''
        expected = ('theoretical bubble of 2 stages per rank '
                    f'{bound}(p-1)/(v*m+p-1) = 0.111')
        assert any(n.endswith(expected) for n in plans[0].notes)


def _real_stage_shard_numel(rank, stage):
    """Parameters ``rank`` of 4 holds of ``stage`` under a real FSDP2 over
    the data axis of pp=2 x dp=2 (fake group)."""
    from mmpar.models import DigitsViT
    from mmpar.parallel import init_parallelism, reset_parallelism
    from mmpar.parallel.config import ParallelConfig
    from mmpar.parallelize.pipeline.split import split_stage
    from mmpar.wrappers import build_model_wrapper
    from torch.testing._internal.distributed.fake_pg import FakeStore
    root = Path(__file__).resolve().parents[2]
    cfg = Config.fromfile(str(root / 'configs/vit_digits/vit_digits_pp.py'))
    model = DigitsViT(**{k: v for k, v in cfg.model.items() if k != 'type'})
    dist.init_process_group('fake', store=FakeStore(), rank=rank,
                            world_size=4)
    try:
        from mmpar.parallelize.compose import data_axis_args
        wrapper_cfg = dict(type='MMFullyShard')
        topology = init_parallelism(
            dims=ParallelConfig.from_cfg(cfg.parallel).dims(4, wrapper_cfg))
        built = build_model_wrapper(
            wrapper_cfg, split_stage(model, [0, 2], stage),
            default_args=data_axis_args(wrapper_cfg, topology))
        return sum(p.to_local().numel() for p in built.parameters())
    finally:
        reset_parallelism()
        dist.destroy_process_group()


@pytest.mark.parametrize('rank', [0, 3])
def test_pipeline_memory_is_also_sharded_over_dp(rank):
    """pp=2 x FSDP2 dp=2 on 4 ranks: a rank holds its dp shard of its stage
    (about half, plus per-parameter padding), one FSDP root per stage."""
    plan = _pp_plan(4, rank, model_wrapper_cfg=dict(type='MMFullyShard'))
    numels = _stage_numels(plan, 2)
    (stage, ) = plan.pp_stages
    assert [u.name for u in plan.units] == [f'(stage {stage} root)']
    assert plan.units[0].numel == numels[stage]
    count = plan.memory[0][1]
    assert count == _real_stage_shard_numel(rank, stage)
    assert numels[stage] / 2 <= count < 0.55 * numels[stage]


def test_plan_the_model_cannot_run_fails_the_plan_naming_the_module():
    """tools/plan.py runs the split model's first call on the meta device
    as training does: timm's fused qkv split without its output projection
    (which then gets half its input) is a PlanError naming both. (Valid
    plans pass the same dry run in every other tp test here.)"""
    cfg = Config.fromfile(str(DATA.parents[1] / 'configs' / 'vit_digits' /
                               'vit_digits_tp_custom.py'))
    cfg.model.fused_qkv = True
    qkv = dict(style='colwise', fused=3)
    cfg.parallel.tp_plan.plan = {'blocks.*.attn.qkv': qkv}
    with pytest.raises(PlanError, match=(
            r"^parallel.tp_plan: the split model cannot run: .* fails in "
            r"'blocks.0.attn.proj' after 'blocks.0.attn.qkv' \(style "
            r"dict\(style='colwise', fused=3\)\) returned its split output: "
            r"RuntimeError: .*\[512, 32\] X \[64, 64\]")):
        make_plan(cfg, 2, 0)
