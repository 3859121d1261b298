"""benchmarks/bench_context_parallel.py with its --quick plan on 1 and 2
gloo ranks (shape and sense, not speed): at cp=2 a rank keeps half the
activations of cp=1, both ranks compute as many attention scores, and the
report has its table and verdict."""
import torch.distributed as dist

from benchmarks import bench_context_parallel as bench


def _as_only_rank(init_file, fn, *args):
    """``fn(*args)`` in this process as the one rank of a gloo group (a
    1-rank pool, used by no other test, would start a process for it)."""
    dist.init_process_group('gloo', init_method=f'file://{init_file}',
                            rank=0, world_size=1)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def test_cp2_halves_activations_and_reports(run_dist, tmp_path,
                                            monkeypatch):
    plan = dict(bench.load_plan(quick=True, steps=1), lengths=(32, 64))
    for key in ('RANK', 'LOCAL_RANK'):
        monkeypatch.setenv(key, '0')
    for key in ('WORLD_SIZE', 'LOCAL_WORLD_SIZE'):
        monkeypatch.setenv(key, '1')
    rows = bench.add_plan_estimates(
        _as_only_rank(tmp_path / 'init', bench.measure, plan) +
        run_dist(bench.measure, plan, world_size=2)[0], plan)
    by = {(r['cp'], r['length']): r for r in rows}
    for length in plan['lengths']:
        one, two = by[1, length], by[2, length]
        assert two['saved'] <= bench.GOAL * one['saved'], (one, two)
        assert two['balance'] == 1.0 and two['tokens_per_s'] > 0
        # The plan's estimate is of the measured size (not a stand-in).
        assert 0.5 < one['estimate'] / one['saved'] < 2, one
    conditions = dict(date='now', machine='here', load_before=0.0,
                      load_after=0.0, wall_s=1.0)
    bench_cps, bench.CPS = bench.CPS, (1, 2)
    try:
        text = bench.report(rows, plan, conditions)
    finally:
        bench.CPS = bench_cps
    assert '| 64 | 2 |' in text and 'meets the goal of <= 0.6' in text
