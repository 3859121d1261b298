"""One run parses and checks each parallel section once: ``check_config``
resolves the plan (:mod:`mmpar.parallelize.resolved`) and the Runner hands
it to ``setup_parallelism``, the model build and compose. And it formats
its config text once (yapf's ``FormatCode``), though MMEngine asks for it
at the start-up log, the dumped config, the metainfo and every checkpoint
(:mod:`mmpar.runner.run_config`).

Each rank counts the calls of the parsers and checks, by code object (a
profile hook sees a call however the function was imported), while it
builds a Runner from a config and trains it, as ``tools/train.py`` does.
"""
import sys
from collections import Counter

from tests.trained import small_cfg

PP_CONFIG = 'configs/vit_digits/vit_digits_pp.py'
DDP_CONFIG = 'configs/vit_digits/vit_digits.py'


def _counted():
    """``{name: (code object, counts the call?)}``."""
    from mmpar.parallel.config import ParallelConfig
    from mmpar.parallel.dims import resolve_dims
    from mmpar.parallelize import resolved
    from mmpar.parallelize.pipeline.config import PipelineConfig
    from mmpar.wrappers import builder
    from yapf.yapflib.yapf_api import FormatCode
    return {
        'FormatCode': (FormatCode.__code__, None),
        # A dict (or None) becoming a ParallelConfig, not one handed on.
        'ParallelConfig.from_cfg': (
            ParallelConfig.from_cfg.__func__.__code__,
            lambda f: not isinstance(f.f_locals['cfg'], ParallelConfig)),
        'resolve_dims': (resolve_dims.__code__, None),
        'PipelineConfig.from_cfg': (
            PipelineConfig.from_cfg.__func__.__code__, None),
        'PipelineConfig.check': (PipelineConfig.check.__code__, None),
        'check_composition': (resolved.check_composition.__code__, None),
        'check_wrapper_cfg': (builder.check_wrapper_cfg.__code__, None),
        'default_wrapper_cfg': (builder.default_wrapper_cfg.__code__, None),
        'resolve_plan': (resolved.resolve_plan.__code__, None),
    }


def count_calls(run):
    """Run ``run()`` and return how often each function was called."""
    targets = {code: (name, test) for name, (code, test) in
               _counted().items()}
    counts = Counter({name: 0 for name, _ in targets.values()})

    def trace(frame, event, arg):
        # Called once per new Python frame; None: no line tracing.
        if frame.f_code in targets:
            name, test = targets[frame.f_code]
            if test is None or test(frame):
                counts[name] += 1

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(previous)
    return dict(counts)


def _train(config, work_dir, name, train, **extra):
    from mmpar.runner import Runner
    cfg = small_cfg(config, work_dir, 1, name, 'full', **extra)

    def run():
        runner = Runner.from_cfg(cfg)
        if train:
            runner.train()
    return count_calls(run)


ONCE = {
    'FormatCode': 1, 'ParallelConfig.from_cfg': 1, 'resolve_dims': 1, 'check_composition': 1,
    'check_wrapper_cfg': 1, 'resolve_plan': 1,
}


def test_a_pipeline_run_parses_each_section_once(run_dist, tmp_path):
    # pp=2 with no wrapper named: the default one is computed once, the
    # pipeline section parsed (and checked) once.
    # (The small ViT has 2 blocks: one per stage.)
    parallel = dict(pp=2, pipeline=dict(
        split_points=['blocks.1'], schedule='1F1B', num_microbatches=4))
    for counts in run_dist(_train, PP_CONFIG, str(tmp_path),
                           'parsed_once_pp', True, parallel=parallel):
        assert counts == dict(ONCE, **{
            'PipelineConfig.from_cfg': 1, 'PipelineConfig.check': 1,
            'default_wrapper_cfg': 1}), counts


def test_a_named_wrapper_is_checked_once_not_again_at_build(run_dist,
                                                            tmp_path):
    # dp=2 with DDP named: the wrapper is built, and not checked again.
    wrapper = dict(type='MMDistributedDataParallel', broadcast_buffers=False)
    for counts in run_dist(_train, DDP_CONFIG, str(tmp_path),
                           'parsed_once_ddp', False,
                           model_wrapper_cfg=wrapper):
        assert counts == dict(ONCE, **{
            'PipelineConfig.from_cfg': 0, 'PipelineConfig.check': 0,
            'default_wrapper_cfg': 0}), counts


def test_the_counter_sees_a_second_parse():
    # The counter is not blind: parsing the section again is counted.
    from mmpar.parallel.config import ParallelConfig
    from mmpar.parallelize.pipeline.config import PipelineConfig

    def parse_twice():
        config = ParallelConfig.from_cfg(dict(pp=2))
        ParallelConfig.from_cfg(config)  # handed on: not a parse
        ParallelConfig.from_cfg(dict(pp=2))
        PipelineConfig.from_cfg(dict(schedule='GPipe'))
    counts = count_calls(parse_twice)
    assert counts['ParallelConfig.from_cfg'] == 2
    assert counts['PipelineConfig.from_cfg'] == 1
    assert counts['check_composition'] == 0


def test_one_process_run_resolves_once(tmp_path):
    counts = _train(DDP_CONFIG, tmp_path, 'parsed_once_one', False,
                    launcher='none')
    assert counts['ParallelConfig.from_cfg'] == 1
    assert counts['resolve_plan'] == 1
    assert counts['FormatCode'] == 1
    assert counts['default_wrapper_cfg'] == 1
    assert counts['check_composition'] == 0  # nothing to compose at 1 rank
