"""benchmarks/bench_async_checkpoint.py --llama without its two 100 M runs
(minutes of CPU): the config it launches, the clock it reads and how it
sorts iterations into normal, saving and after-a-save."""
import json

from mmengine.config import Config

from benchmarks import bench_async_checkpoint as bench
from benchmarks._iter_clock import iteration_seconds
from mmpar.config_check import check_config


def test_llama_config_is_the_judged_case(tmp_path):
    for use_async in (False, True):
        cfg = Config.fromfile(bench.llama_config(
            str(tmp_path), use_async, iters=14, interval=4, context=128))
        plan = check_config(cfg, world_size=4)
        assert plan.wrapper_cfg['type'] == 'MMFullyShard'
        assert cfg.checkpoint_format == 'sharded'
        hook = cfg.default_hooks.checkpoint
        assert (hook.async_save, hook.interval, hook.by_epoch) == (
            use_async, 4, False)
        assert (cfg.model.dim, cfg.model.num_layers) == (1024, 8)
        assert [h['type'] for h in cfg.custom_hooks] == ['IterClock']


def test_slowest_rank_per_iteration(tmp_path):
    for rank, ends in enumerate([[1.0, 3.0, 4.0], [1.5, 2.5, 4.5]]):
        (tmp_path / f'iter_clock_rank{rank}.json').write_text(
            json.dumps(dict(start=0.0, ends=ends)))
    assert iteration_seconds(str(tmp_path)) == [1.5, 2.0, 2.0]


def test_iterations_sorted_by_kind():
    # Iterations 1..10, saves every 4: 4 and 8 save (1 and 10 left out).
    seconds = [100.0, 2.0, 3.0, 40.0, 5.0, 6.0, 7.0, 80.0, 9.0, 1000.0]
    assert bench.split_saving(seconds, 4) == dict(
        normal=[2.0, 3.0, 6.0, 7.0], saves=[40.0, 80.0], after=[5.0, 9.0])
