"""benchmarks/run.py: every strategy is measured on 2 gloo ranks and the
report section and chart are written (the --quick plan: a step or two each,
so the numbers are checked for shape and sense, not speed)."""
import math
import os
import time

import pytest

from benchmarks import run as bench
from tests.dist_harness import DistPool

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


@pytest.fixture(scope='module')
def quick(_pools, tmp_path_factory):
    """One --quick measurement on 2 ranks, shared by the tests here: the
    plan, the result, the report and its output folder."""
    plan = bench.load_plan(quick=True)
    out = tmp_path_factory.mktemp('bench')
    # An existing section of the page must survive the rewrite.
    (out / 'benchmarks.md').write_text(
        '# Benchmarks\n\n## Data-parallel wrappers\n\nkeep me\n')
    pool = _pools.get(2)
    if pool is None or pool.broken:
        pool = _pools[2] = DistPool(2)
    start = time.time()
    result = pool.run(bench.measure, plan)[0]
    report = bench.write_report(result, plan, str(out), 2, start,
                                os.getloadavg()[0])
    return plan, result, report, out


def _table_rows(report: str, first_header: str):
    """The body rows of the Markdown table whose header starts with
    ``| first_header |``, as lists of cells."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith(f'| {first_header} |'))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith('|'):
            break
        rows.append([cell.strip() for cell in line.strip('|').split('|')])
    return rows


def test_report_section_and_chart_are_written(quick):
    _, _, report, out = quick
    text = (out / 'benchmarks.md').read_text()
    assert 'keep me' in text and bench.SECTION in text
    assert f']({bench.CHART})' in text
    assert (out / bench.CHART).read_bytes()[:8] == PNG_MAGIC
    assert 'load average' in report


def test_table_has_every_strategy_with_positive_ratios(quick):
    plan, _, report, _ = quick
    rows = _table_rows(report, 'model')
    models = [spec['name'] for spec in plan['models']]
    expected = {(m, s) for m in models for s in plan['strategies']}
    assert len(rows) == len(expected)
    assert {(r[0], r[1]) for r in rows} == expected
    for row in rows:
        step_ms, samples, ratio = float(row[2]), float(row[3]), row[4]
        assert step_ms > 0 and samples > 0
        assert ratio.endswith('x') and 0 < float(ratio[:-1]) < math.inf


def test_fsdp_holds_less_model_state_than_ddp(quick):
    plan, result, _, _ = quick
    for spec in plan['models']:
        state = {r['strategy']: r['state_bytes'] for r in result['rows']
                 if r['model'] == spec['name']}
        assert state[bench.DDP_ROW] > 0
        for name in ('MMFullyShardedDataParallel, FULL_SHARD',
                     'MMFullyShard, FULL_SHARD'):
            # Sharded over 2 ranks: about half of DDP's (padding aside).
            assert state[name] < 0.6 * state[bench.DDP_ROW], (spec, name)


def test_rounds_per_sync_strategy(quick):
    _, result, report, _ = quick
    k = bench.ACCUMULATION
    ddp = {c['sync_strategy']: c['rounds'] for c in result['counts']
           if c['wrapper'] == 'MMDistributedDataParallel'}
    # rel 1e-3: forced_sync's buckets carry one flag per parameter with the
    # gradients (56 floats of ~136k on the default example).
    assert ddp == pytest.approx(
        dict(single_auto_sync=1, multi_auto_sync=k, forced_sync=1), rel=1e-3)
    assert len(result['counts']) == len(_table_rows(report, 'wrapper'))
    for count in result['counts']:
        # FSDP pads its flat shards, so its bytes run a little over.
        assert count['rounds'] == pytest.approx(count['expected'], rel=0.05)


def test_forced_sync_makes_one_collective_per_bucket(quick):
    _, result, _, _ = quick
    forced = [c for c in result['counts']
              if c['sync_strategy'] == 'forced_sync']
    assert forced  # DDP's forced_sync is counted even in --quick
    for count in forced:
        assert count['buckets'] >= 1
        assert count['calls'] == count['buckets']


def test_rows_are_compared_with_their_own_baseline(quick):
    plan, result, report, _ = quick
    for own_row, baseline in bench.OWN_BASELINE.items():
        assert own_row in plan['strategies'] and baseline in plan['strategies']
    for row in result['rows']:
        if row['strategy'] in bench.OWN_BASELINE:
            assert row['own_baseline'] == bench.OWN_BASELINE[row['strategy']]
            assert all(r > 0 for r in row['own_paired_ratios'])
    cells = {r[1]: r[6] for r in _table_rows(report, 'model')}
    assert cells[bench.FSDP1_ROW].endswith(f'vs {bench.FSDP1_BASELINE}')
    assert cells[bench.FSDP2_ROW].endswith(f'vs {bench.FSDP2_BASELINE}')
    assert cells[bench.DDP_FORCED_ROW].endswith(f'vs {bench.DDP_ROW}')
    assert 'goal <= 1.10x' in report
