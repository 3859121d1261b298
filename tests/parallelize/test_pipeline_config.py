"""Bad pipeline input fails at start-up naming the key, the value and what
is allowed; the split keeps the original parameter names."""
import pytest
import torch

from mmpar.config_check import check_layout
from mmpar.failures import ConfigError
from mmpar.parallelize.pipeline import (check_protocol, split_stage,
                                        stage_starts)
from mmpar.parallelize.pipeline.config import PipelineConfig
from mmpar.parallelize.pipeline.schedules import (schedule_class,
                                                  theoretical_bubble)
from mmpar.registry import PIPELINE_SCHEDULES, registered_names
from tests.parallelize.pipeline_cases import make_pipe_model
from tests.toy import make_model


def _check(pipeline, batch_size=8):
    return check_layout(dict(parallel=dict(pp=2, pipeline=pipeline),
                             train_dataloader=dict(batch_size=batch_size)),
                        world_size=2)


def test_the_registry_holds_torchs_schedules():
    names = registered_names(PIPELINE_SCHEDULES)
    for name in ('GPipe', '1F1B', 'Interleaved1F1B', 'InterleavedZeroBubble',
                 'ZBVZeroBubble'):
        assert name in names
    assert schedule_class('1F1B').__module__.startswith('torch.distributed')


@pytest.mark.parametrize('name,v,expected,formula', [
    # p=2, m=4: GPipe/1F1B 1/5; v=2 stages per rank: 1/9.
    ('GPipe', 1, 1 / 5, '(p-1)/(m+p-1)'),
    ('1F1B', 1, 1 / 5, '(p-1)/(m+p-1)'),
    ('Interleaved1F1B', 2, 1 / 9, '(p-1)/(v*m+p-1)'),
    ('LoopedBFS', 2, 1 / 9, '(p-1)/(v*m+p-1)'),
    ('InterleavedZeroBubble', 2, 1 / 9, '<= (p-1)/(v*m+p-1)'),
    ('ZBVZeroBubble', 2, 1 / 9, '<= (p-1)/(v*m+p-1)'),
    ('DualPipeV', 2, 1 / 9, '<= (p-1)/(v*m+p-1)'),
])
def test_theoretical_bubble(name, v, expected, formula):
    assert theoretical_bubble(name, 2, 4, v) == (pytest.approx(expected),
                                                 formula)


def test_theoretical_bubble_of_an_unknown_schedule_lists_the_known():
    with pytest.raises(ValueError, match="schedule='Foo'.*1F1B"):
        theoretical_bubble('Foo', 2, 4)


@pytest.mark.parametrize('pipeline,named', [
    (dict(schedule='Foo'),
     r"schedule='Foo' is not a registered pipeline schedule; registered: "
     r'1F1B, DualPipeV, GPipe, Interleaved1F1B'),
    (dict(schedule='Interleaved1F1B'),
     r'stages_per_rank=1 is not allowed; allowed: an int >= 2'),
    (dict(schedule='ZBVZeroBubble', stages_per_rank=3),
     r'stages_per_rank=3 is not allowed; allowed: 2'),
    (dict(schedule='1F1B', stages_per_rank=2),
     r'stages_per_rank=2 is not allowed; allowed: 1 with'),
    (dict(num_microbatches=3),
     r'num_microbatches=3 is not allowed; allowed: a divisor of the '
     r'per-rank batch size 8'),
    (dict(num_microbatches=0), r'num_microbatches=0 is not allowed'),
    (dict(split_points=['layers.1', 'layers.2']),
     r"split_points=\['layers.1', 'layers.2'\] is not allowed; allowed: 1 "
     r'names \(pp=2 x stages_per_rank=1'),
    (dict(split_points='layers.2'), r"split_points='layers.2'"),
    # Not iterable: the message was only "'int' object is not iterable".
    (dict(split_points=3), r'parallel.pipeline.split_points=3 is not '
     r'allowed; allowed: a list of module names'),
    (dict(num_stages=2), r'parallel.pipeline.num_stages=2 is not allowed'),
    (dict(reshard_per_microbatch=1),
     r'parallel.pipeline.reshard_per_microbatch=1 is not allowed; allowed: '
     r'True \(FSDP2 stages .*\) or False'),
])
def test_bad_pipeline_sections_fail_at_start_up(pipeline, named):
    with pytest.raises(ConfigError, match=named):
        _check(pipeline)


def test_a_good_section_passes():
    section = dict(schedule='Interleaved1F1B', stages_per_rank=2,
                   split_points=['layers.1', 'layers.2', 'layers.3'],
                   num_microbatches=4)
    plan = _check(section)
    dims = plan.dims
    assert dims.pp == 2 and plan.parallel.pipeline == section
    pipeline = plan.pipeline  # parsed once, by the check
    assert pipeline == PipelineConfig.from_cfg(section, pp=dims.pp)
    assert (pipeline.schedule, pipeline.num_stages(dims.pp),
            pipeline.num_microbatches) == ('Interleaved1F1B', 4, 4)


def test_split_points_are_checked_against_the_model():
    model = make_pipe_model()
    with pytest.raises(ValueError, match=r"'layers.9' names no layer of "
                       r'PipeMLP; allowed: layers.1, layers.2, layers.3'):
        stage_starts(model, ['layers.9'], 2)
    with pytest.raises(ValueError, match=r'out of order at .layers.1.'):
        stage_starts(model, ['layers.2', 'layers.1', 'layers.3'], 4)
    with pytest.raises(ValueError, match=r'asks for 6 stages but PipeMLP '
                       r"has 4 layers in 'layers'"):
        stage_starts(model, None, 6)
    assert stage_starts(model, None, 3) == [0, 2, 3]


def test_a_model_without_the_protocol_is_refused_naming_what_is_missing():
    with pytest.raises(ValueError, match=r'ToyModel cannot be pipelined.*'
                       r'no pipeline_layers, pipeline_pre, pipeline_post, '
                       r'pipeline_embed, pipeline_head'):
        check_protocol(make_model())


def test_pipeline_kwargs_without_pipeline_layer_are_refused():
    model = make_pipe_model()
    check_protocol(model)
    model.pipeline_kwargs = ('doc_ids', )
    with pytest.raises(ValueError, match=r"PipeMLP.pipeline_kwargs="
                       r"\('doc_ids',\) needs a pipeline_layer"):
        check_protocol(model)


def test_stages_keep_the_original_names_and_together_are_the_model():
    model = make_pipe_model()
    starts = stage_starts(model, ['layers.1', 'layers.2', 'layers.3'], 4)
    stages = [split_stage(model, starts, i) for i in range(4)]
    names = [list(s.state_dict()) for s in stages]
    assert names[1] == ['layers.1.0.weight', 'layers.1.0.bias']
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    assert sum(map(len, names)) == len(model.state_dict())
    model.load_state_dict(merged, strict=True)
    inputs = torch.randn(2, 8)
    x = inputs
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(inputs))


@pytest.mark.parametrize('pipeline,expected', [
    # mmpar's stage reshards per micro-batch: shard as a whole model.
    (dict(schedule='1F1B'), {}),
    # torch's schedule keeps the stage gathered from the first backward on:
    # resharding after forward would only add all-gathers.
    (dict(schedule='1F1B', reshard_per_microbatch=False),
     dict(reshard_after_forward=False)),
    (dict(schedule='InterleavedZeroBubble', stages_per_rank=2),
     dict(reshard_after_forward=False)),
])
def test_fsdp2_stage_arguments_follow_the_schedules_resharding(pipeline,
                                                               expected):
    from mmpar.parallelize.pipeline import PipelineConfig
    from mmpar.parallelize.resolved import stage_wrapper_cfg
    pipeline = PipelineConfig.from_cfg(pipeline)
    cfg = dict(type='MMFullyShard')
    assert stage_wrapper_cfg(cfg, pipeline) == dict(cfg, **expected)
    # What the user set wins.
    assert stage_wrapper_cfg(dict(cfg, reshard_after_forward=True),
                             pipeline)['reshard_after_forward'] is True
    ddp = dict(type='MMDistributedDataParallel')
    assert stage_wrapper_cfg(ddp, pipeline) == ddp
