"""benchmarks/bench_llm.py: every layout and both hand-written loops are
measured on 2 gloo ranks (the --quick plan: checked for shape and sense, not
speed) and the report section is written."""
import pytest
import torch

from benchmarks import bench_llm
from benchmarks._common import write_section
from tests.dist_harness import DistPool


@pytest.fixture(scope='module')
def quick(_pools):
    plan = bench_llm.load_plan(quick=True)
    pool = _pools.get(2)
    if pool is None or pool.broken:
        pool = _pools[2] = DistPool(2)
    rows = pool.run(bench_llm.measure, plan)[0]
    bench_llm.add_ratios(rows)
    return plan, rows


def test_every_layout_has_a_row_with_sane_numbers(quick):
    plan, rows = quick
    assert [r['strategy'] for r in rows] == list(plan['strategies'])
    by_name = {r['strategy']: r for r in rows}
    for row in rows:
        assert row['tokens_per_s'] > 0 and row['vs_hand_written'] > 0
        assert row['paired'] > 0
        assert row['state_bytes'] > 0
    assert by_name[bench_llm.HAND_DDP]['vs_hand_written'] == 1.0
    assert by_name['MMFullyShard']['baseline'] == bench_llm.HAND_FSDP2
    # Sharding halves parameters, gradients and AdamW state on 2 ranks.
    for name in ('MMFullyShard', 'MMFullyShardedDataParallel',
                 bench_llm.HAND_FSDP2):
        assert by_name[name]['vs_ddp_state'] < 0.6, name
    assert by_name['MMDistributedDataParallel']['vs_ddp_state'] == \
        pytest.approx(1.0)


def test_report_section_is_written(quick, tmp_path):
    plan, rows = quick
    (tmp_path / 'benchmarks.md').write_text('# Benchmarks\n\n## Other\n\nkeep\n')
    meta = dict(machine='m', date='d', load_before=0.0, load_after=0.0)
    report = bench_llm.format_report(rows, plan, meta)
    write_section(str(tmp_path / 'benchmarks.md'),
                            bench_llm.SECTION, report)
    text = (tmp_path / 'benchmarks.md').read_text()
    assert 'keep' in text and bench_llm.SECTION in text
    assert text.count('| MM') == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_bf16_compile_and_fsdp2_report_tokens_and_mfu():
    bench_llm._init_single_process_group()
    try:
        model = bench_llm.load_plan(quick=True)['model']
        rows = bench_llm.run_cuda(model, 8, 64, 3)
    finally:
        torch.distributed.destroy_process_group()
    assert [r['variant'] for r in rows] == [
        'eager', 'compile per block', 'FSDP2 (1 GPU)']
    for row in rows:
        assert row['tokens_per_s'] > 0 and row['flops_per_s'] > 0
