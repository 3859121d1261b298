"""benchmarks/bench_pipeline.py: a single-stage, an interleaved and both V
schedules at pp=2 on 2 gloo ranks against pp=1 (the --quick model, one step
per row): the rows are well formed and the report section is written. Not a
timing test: the numbers are checked for shape and sense, not speed."""
import pytest

from benchmarks import bench_pipeline
from tests.dist_harness import DistPool

SCHEDULES = ('1F1B', 'Interleaved1F1B', 'ZBVZeroBubble', 'DualPipeV')
MICROBATCHES = (2, 4)


@pytest.fixture(scope='module')
def quick(_pools):
    plan = bench_pipeline.load_plan(True, schedules=SCHEDULES,
                                    microbatches=MICROBATCHES)
    pool = _pools.get(2)
    if pool is None or pool.broken:
        pool = _pools[2] = DistPool(2)
    return plan, pool.run(bench_pipeline.measure, plan)[0]


def test_every_schedule_and_microbatch_count_has_a_row(quick):
    plan, rows = quick
    assert [(r['schedule'], r['microbatches']) for r in rows] == [
        (s, m) for s in SCHEDULES for m in MICROBATCHES]
    assert plan['steps'] == 1 and plan['warmup'] == 1


def test_numbers_are_well_formed(quick):
    _, rows = quick
    for row in rows:
        assert row['pp'] == 2
        if row['schedule'] == 'DualPipeV' and row['microbatches'] == 2:
            # torch refuses fewer micro-batches than its 4 stages.
            assert row['skipped'].startswith('not run: torch needs m >= 4')
            assert 'pp_s' not in row
            continue
        assert row['pp_s'] > 0 and row['single_s'] > 0 and row['ratio'] > 0
        assert row['ratio'] == pytest.approx(row['pp_s'] / row['single_s'])
        assert row['idle'] == pytest.approx(1 - 1 / (2 * row['ratio']))
        # Idle shares of the ranks' time: below 1; the step-time one may
        # dip below 0 only if pp=2 beat a perfect 2x speed-up (noise).
        assert -1 < row['idle'] < 1
        assert 0 <= row['stage_idle'] < 1


def test_theory_is_the_formula(quick):
    _, rows = quick
    for row in rows:
        p, m, v = 2, row['microbatches'], row['stages_per_rank']
        if row['schedule'] == '1F1B':
            assert v == 1 and row['formula'] == '(p-1)/(m+p-1)'
            assert row['theory'] == pytest.approx((p - 1) / (m + p - 1))
        else:
            assert v == 2
            assert row['theory'] == pytest.approx((p - 1) / (v * m + p - 1))
        bound = row['schedule'] in ('ZBVZeroBubble', 'DualPipeV')
        assert row['formula'].startswith('<= ') == bound


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'Foo' is not allowed; allowed: "
                       'GPipe, 1F1B'):
        bench_pipeline.load_plan(True, schedules=['Foo'])


def test_report_section_is_written(quick, tmp_path):
    plan, rows = quick
    page = tmp_path / 'benchmarks.md'
    page.write_text('# Benchmarks\n\n## Other\n\nkeep\n')
    meta = dict(machine='m', date='d', load_before=3.0, load_after=4.0)
    report = bench_pipeline.format_report(rows, plan, meta)
    bench_pipeline.write_section(str(page), bench_pipeline.SECTION, report)
    text = page.read_text()
    assert 'keep' in text and bench_pipeline.SECTION in text
    assert 'load average 3.00' in report and 'Noisy' in report
    table = [line for line in report.splitlines()
             if line.startswith('| ') and not line.startswith('| schedule')]
    assert len(table) == len(rows)
    assert all(line.count('|') == 11 for line in table)
    skipped = [line for line in table if '| DualPipeV | 2 | 2 |' in line]
    assert len(skipped) == 1 and 'not run' in skipped[0]
