"""benchmarks/bench_clean_exits.py without launching anything (one job is
two torchrun launches, tens of CPU-seconds): its job plan, its configs, the
tail it prints for a failed launch and its report."""
from mmengine.config import Config

from benchmarks import bench_clean_exits as bench


def test_jobs_cycle_through_every_layout_and_size():
    jobs = bench.plan_jobs(5, ['ddp', 'fsdp2'], [2, 4])
    assert [(j.layout, j.nproc) for j in jobs] == [
        ('ddp', 2), ('fsdp2', 2), ('ddp', 4), ('fsdp2', 4), ('ddp', 2)]
    assert [j.index for j in jobs] == list(range(5))


def test_configs_are_the_shipped_ones_made_short(tmp_path):
    configs = bench.write_configs(str(tmp_path))
    assert set(configs) == set(bench.LAYOUTS)
    tp = Config.fromfile(configs['tp'])
    assert tp.parallel.tp == 2  # from configs/vit_digits/vit_digits_tp.py
    for path in configs.values():
        cfg = Config.fromfile(path)
        assert cfg.train_cfg == dict(by_epoch=False, max_iters=bench.ITERS,
                                     val_interval=bench.ITERS)
        assert cfg.default_hooks.checkpoint.interval == bench.ITERS


def test_a_failed_launch_shows_the_ranks_last_lines_and_exit_codes():
    output = '\n'.join(
        [f'rank line {i}' for i in range(50)] +
        ['terminate called without an active exception',
         'E1127 ... failed (exitcode: -6) local_rank: 1 (pid: 7)',
         'Traceback (most recent call last):', '  File "run.py"',
         '  exitcode  : -15 (pid: 6)', '  traceback : Signal 15',
         '  exitcode  : -6 (pid: 7)', '  traceback : Signal 6 (SIGABRT)'])
    tail = bench.Launch(['bash'], returncode=1, output=output).tail(3)
    assert tail.splitlines() == [
        'rank line 48', 'rank line 49',
        'terminate called without an active exception',
        'E1127 ... failed (exitcode: -6) local_rank: 1 (pid: 7)',
        '  exitcode  : -15 (pid: 6)', '  traceback : Signal 15',
        '  exitcode  : -6 (pid: 7)', '  traceback : Signal 6 (SIGABRT)']


def test_report_counts_failed_launches():
    jobs = bench.plan_jobs(2, ['ddp'], [2])
    jobs[0].launches = [bench.Launch(['a'], 0), bench.Launch(['b'], 1)]
    summary = dict(num_jobs=1, planned_jobs=2, max_minutes=30,
                   layouts=['ddp'], nprocs=[2], parallel=4, busy=0,
                   starve_gloo=False, num_launches=2, num_failed=1,
                   wall_s=90, cpus=2, date='d', load_mean=7.5, load_max=12)
    report = bench.format_report(summary)
    assert report.startswith('1 jobs (of 2 planned: no job started after '
                             '30 min) (ddp; 2 ranks)')
    assert '**1 of 2 launches exited non-zero**' in report
    assert 'load average 7.5 on average, 12.0 at most' in report
