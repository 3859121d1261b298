"""benchmarks/bench_layout_search.py's judged numbers from the two jobs'
search.json (made-up rows, nothing launched; the launches themselves are
tests/analysis/test_layout_search.py's): the pick is rated by the sweep's
throughput, the time by the launches' wall time, the memory by each
candidate's first and largest measured peak."""
import pytest

from benchmarks import bench_layout_search as bench

MiB = 2**20


def _row(layout, throughput, predicted, peaks, status='measured'):
    return dict(layout=layout, status=status, throughput=throughput,
                predicted_peak=predicted * MiB,
                measured_peak=max(peaks, default=0) * MiB,
                trial_peaks=[p * MiB for p in peaks],
                trial_medians=[0.1] * len(peaks))


def test_the_pick_time_and_memory_are_rated_by_the_sweep():
    sweep = dict(global_batch=16, elapsed_s=90.0, wall_s=100.0, command='b',
                 rows=[_row('dp_shard=4', 1000, 400, [380, 420]),
                       _row('pp=4', 960, 300, [300, 330]),
                       _row('tp=4', 200, 100, [100, 100]),
                       _row('cp=4', None, 100, [], status='over budget')])
    # The search's own (disturbed) numbers put pp=4 first: the sweep's
    # numbers rate it.
    search = dict(global_batch=16, elapsed_s=20.0, wall_s=30.0, command='a',
                  rows=[_row('pp=4', 5000, 300, [300]),
                        _row('dp_shard=4', 900, 400, [380])])
    got = bench.compare(dict(search=search, sweep=sweep))
    assert (got['pick'], got['fastest']) == ('pp=4', 'dp_shard=4')
    assert got['ratio'] == pytest.approx(0.96)
    assert got['time_ratio'] == pytest.approx(0.3)
    assert got['trial_time_ratio'] == pytest.approx(20 / 90)
    assert set(got['errors']) == {'dp_shard=4', 'pp=4', 'tp=4'}
    assert got['errors']['dp_shard=4'] == pytest.approx((20 / 380,
                                                         -20 / 420))
    plan = bench.load_plan(quick=True, steps=0)
    text = bench.report(dict(search=search, sweep=sweep), plan,
                        dict(date='now', machine='here', load_before=9.0,
                             load_after=8.0, wall_s=130.0))
    assert 'runs at 0.960 x the sweep\'s fastest (`dp_shard=4`) — goal ' \
        '>= 0.95: met' in text
    assert '0.30 (0.22 without' in text and '<= 0.33: met' in text
    # Worst: dp_shard=4's first trial (+5.3 %), pp=4's largest peak (-9.1 %).
    assert 'within 5.3% for every candidate\'s first trial and 9.1% over ' \
        'all its trials' in text
    assert '| pp=4 | 300 | 300 | +0.0% | 330 | -9.1% |' in text
    assert 'The machine was loaded' in text
