"""benchmarks/bench_data.py on a small shard: the numbers it reports are
there and make sense (the goals are measured by the full run,
docs/benchmarks.md)."""
from benchmarks import bench_data


def test_bench_data_reports_rates_and_memory():
    result = bench_data.measure(shard_mib=4, batches=3, steps=1)
    assert result['shard_tokens'] == 2 * 2**20
    assert result['windows'] == (2 * 2**20 - 1) // 128
    for key in ('read_tokens_per_s', 'step_tokens_per_s',
                'write_tokens_per_s', 'data_over_step'):
        assert result[key] > 0, key
    # Windows come from the map: a 4 MiB shard is not copied in.
    assert result['rss_anon_growth_mib'] < 4
    assert 'infinite_sampler_rss_anon_mib' in result
