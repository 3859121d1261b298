"""benchmarks/bench_llm_tp.py on 2 gloo ranks with the --quick plan (shape
and sense, not speed): mmpar's tp=2 and its hand-written torch loop make the
Megatron-LM collectives per block and send what the model says, mmpar's
FSDP2 all-gathers as often as plain ``fully_shard``, both pairs train alike,
and the report section is written."""
import pytest

from benchmarks import bench_llm_tp
from benchmarks._common import write_section
from tests.dist_harness import DistPool

MEGATRON = bench_llm_tp.MEGATRON_PER_BLOCK


@pytest.fixture(scope='module')
def quick(_pools):
    plan = bench_llm_tp.load_plan(quick=True, steps=2)
    pool = _pools.get(2)
    if pool is None or pool.broken:
        pool = _pools[2] = DistPool(2)
    rows = (pool.run(bench_llm_tp.measure, plan, 'tp')[0] +
            pool.run(bench_llm_tp.measure, plan, 'fsdp2')[0])
    bench_llm_tp.add_ratios(rows)
    return plan, {r['name']: r for r in rows}


def test_tp_rows_make_the_megatron_collectives(quick):
    plan, rows = quick
    megatron = bench_llm_tp.megatron_bytes(plan, 2)
    for name in ('mmpar tp=2', 'torch TP, hand-written'):
        blocks = rows[name]['blocks']
        assert len(blocks) == plan['model']['num_layers']
        for block in blocks:
            assert block['forward'] == MEGATRON, name
            # mmpar sums the norms' weight gradients (Partial) as backward
            # produces them: 2 small all-reduces per block, no activation.
            activations = {k: n for k, n in block['backward'].items()
                           if k != 'all_reduce'}
            assert activations == MEGATRON, name
        assert 1.0 <= rows[name]['sent'] / megatron <= 1.05, name


def test_pairs_train_alike_and_fsdp2_gathers_as_plain_fully_shard(quick):
    _, rows = quick
    for name in ('mmpar tp=2', 'mmpar FSDP2 dp=2'):
        assert rows[name]['loss_diff'] < 1e-4, name
        assert rows[name]['paired'] > 0 and rows[name]['cpu_paired'] > 0
    assert rows['mmpar FSDP2 dp=2']['kinds']['all_gather'] == \
        rows['torch FSDP2, hand-written']['kinds']['all_gather']


def test_report_section_is_written(quick, tmp_path):
    plan, rows = quick
    (tmp_path / 'benchmarks.md').write_text('# Benchmarks\n\n## Other\n\nkeep\n')
    meta = dict(machine='m', date='d', load_before=2.0, load_after=0.0)
    report = bench_llm_tp.format_report(list(rows.values()), plan, meta)
    write_section(str(tmp_path / 'benchmarks.md'),
                  bench_llm_tp.SECTION, report)
    text = (tmp_path / 'benchmarks.md').read_text()
    assert 'keep' in text and bench_llm_tp.SECTION in text
    assert text.count('| mmpar ') == 2 and 'Noisy' in text
