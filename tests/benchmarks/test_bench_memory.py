"""benchmarks/bench_memory.py on a tiny Llama in the shared 2-rank pool:
its rows have their shape, the meta-device build trains exactly as the
whole build does (same losses), and the report has its tables; the numbers
on the page come from the full run, not from here."""
import math

from benchmarks import bench_memory
from tests.dist_harness import DistPool

TINY = dict(type='Llama', vocab_size=256, dim=64, num_layers=2, num_heads=4,
            max_seq_len=32)


def test_build_rows_and_report(_pools):
    pool = _pools.get(2)
    if pool is None or pool.broken:
        pool = _pools[2] = DistPool(2)
    runs = {meta: pool.run(bench_memory.measure_build, TINY, None, meta, 2, 1,
                           16)[0]['ranks']
            for meta in (True, False)}
    for rows in runs.values():
        assert len(rows) == 2  # every rank's
        for row in rows:
            assert row['build'] > 0 and row['step'] >= row['build']
            assert len(row['step_s']) == 2 and all(
                math.isfinite(x) for x in row['losses'])
    # Built on meta, each rank fills the values one process would: the
    # same losses step by step as the model built whole.
    assert [r['losses'] for r in runs[True]] == \
        [r['losses'] for r in runs[False]]
    sizes = bench_memory._sizes(TINY)
    assert sizes['full'] == 4 * sizes['params'] > sizes['block'] > 0
    build = [dict(sizes=sizes)] + [
        dict(layout='FSDP2', world=2, meta=meta, build=rows[0]['build'],
             step=rows[0]['step'], build_s=rows[0]['build_s'],
             bound=sizes['full'] / 2 + sizes['block'])
        for meta, rows in runs.items()]
    report = bench_memory.format_report(dict(build=build), dict(
        machine='m', date='d', load_before=1.0, load_after=1.0))
    assert report.count('| FSDP2 | 2 |') == 2
    assert '| meta |' in report and '| whole |' in report
    # The big table: one row per layout, each rank's peak range.
    big = [dict(sizes=sizes)] + [
        dict(layout=label, build=runs[True][0]['build'],
             step=max(r['step'] for r in runs[True]),
             peaks=[r['step'] for r in runs[True]],
             step_s=runs[True][0]['step_s'], losses=runs[True][0]['losses'])
        for label, _ in bench_memory.BIG_ROWS]
    report = bench_memory.format_report(dict(big=big), dict(
        machine='m', date='d', load_before=1.0, load_after=1.0))
    assert '| FSDP2 |' in report and '| pp=2 x FSDP2 |' in report
