"""benchmarks/bench_ema.py on its --quick plan (a tiny Llama, 2 gloo ranks,
2 steps): the rows have their shape and the report its table; the numbers
on the page come from the full run, not from here."""
from benchmarks import bench_ema
from tests.dist_harness import DistPool


def test_quick_rows_and_report(_pools):
    plan = bench_ema.load_plan(quick=True)
    pool = _pools.get(2)
    if pool is None or pool.broken:
        pool = _pools[2] = DistPool(2)
    runs = {ema: pool.run(bench_ema.measure, plan, ema)[0]
            for ema in (False, True)}
    for row in runs[True]:
        # FSDP2 on 2 ranks: the averaged copy is this rank's half.
        assert row['averaged_bytes'] == row['shard_bytes'] > 0
    assert all(r['averaged_bytes'] == 0 for r in runs[False])
    rows = bench_ema.compare(runs[False], runs[True])
    assert [r['rank'] for r in rows] == [0, 1]
    report = bench_ema.format_report(rows, plan, dict(
        machine='m', date='d', load_before=1.0, load_after=1.0, wall_s=1.0))
    assert report.count('\n| ') == 3  # the header and a row per rank
