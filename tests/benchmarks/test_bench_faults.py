"""benchmarks/bench_faults.py without launching a run (one killed run is
minutes of CPU): its checkpoint comparison, its moment picker, how it finds
rank processes, its configs and its report."""
import copy
import os
import random
import subprocess
import sys

import torch
from mmengine.config import Config

from benchmarks import bench_faults as bench


def _checkpoint() -> dict:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, generator=gen)
    return dict(
        meta=dict(iter=6, epoch=0, time='12:00',
                  data_position=dict(global_batch=8, samples=48)),
        state_dict={'w': weight, 'b': torch.zeros(4)},
        optimizer=dict(state={0: dict(step=torch.tensor(6.0),
                                      exp_avg=torch.randn(4, 3,
                                                          generator=gen))},
                       param_groups=[dict(lr=1e-3, params=[0])]),
        param_schedulers=[dict(last_epoch=6)])


def test_comparison_finds_one_ulp_in_one_optimizer_state():
    a = _checkpoint()
    b = copy.deepcopy(a)
    b['meta']['time'] = '12:05'  # not training state: ignored
    assert bench.differences(bench.training_state(a),
                             bench.training_state(b)) == []
    exp_avg = b['optimizer']['state'][0]['exp_avg']
    exp_avg[1, 2] = torch.nextafter(exp_avg[1, 2], torch.tensor(1e9))
    assert bench.differences(bench.training_state(a),
                             bench.training_state(b)) == [
                                 '/optimizer/state/0/exp_avg']
    # -0.0 is not 0.0 bit for bit; the data position counts too.
    c = copy.deepcopy(a)
    c['state_dict']['b'][0] = -0.0
    c['meta']['data_position']['samples'] = 40
    assert bench.differences(bench.training_state(a),
                             bench.training_state(c)) == [
                                 '/state_dict/b', '/data_position/samples']


def test_moments_cover_each_kind_and_never_start_with_a_resume():
    for seed in range(20):
        moments = bench.pick_moments(random.Random(seed), 8, async_save=True)
        assert sorted(moments) == sorted(
            ['mid-step', 'mid-collective', 'mid-async-write',
             'during-resume'] * 2)
        assert moments[0] != 'during-resume'
    assert set(bench.pick_moments(random.Random(0), 4, False)) == {
        'mid-step', 'mid-collective', 'mid-save', 'during-resume'}
    assert bench.pick_moments(random.Random(0), 1, False) != [
        'during-resume']


def test_rank_processes_are_the_launchers_children_with_a_rank():
    children = [
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'],
                         env=dict(os.environ, **env))
        for env in ({'RANK': '7'}, {'RANK': '5'}, {})
    ]
    try:
        # Ranks above any the suite's own pools use; a child without RANK
        # is no rank.
        found = bench.rank_pids(os.getpid())
        assert (found[7], found[5]) == (children[0].pid, children[1].pid)
        assert children[2].pid not in found.values()
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_configs_are_the_shipped_ones_made_short(tmp_path):
    for name, layout in bench.LAYOUTS.items():
        cfg = Config.fromfile(
            bench.write_config(str(tmp_path), name, layout, 12, 3))
        assert cfg.train_cfg.max_iters == 12
        assert cfg.default_hooks.checkpoint.interval == 3
        assert cfg.default_hooks.checkpoint.async_save == layout.async_save
        assert cfg.checkpoint_format == layout.checkpoint_format
    tp = Config.fromfile(os.path.join(str(tmp_path), 'faults_tp_fsdp2.py'))
    assert (tp.parallel.tp, tp.model.dim) == (2, 32)


def test_report_says_which_runs_differed():
    good = bench.LayoutResult('ddp', 2, 'full', True, twin_rc=0, run_rc=0,
                              kills=[bench.Kill('mid-step', 1, 3.0, True),
                                     bench.Kill('mid-async-write', 0, 9.0,
                                                False)])
    bad = bench.LayoutResult('pp', 2, 'full', False, twin_rc=0, run_rc=0,
                             diffs=['/state_dict/w'], corrupt_loads=1)
    summary = dict(iters=12, every=3, kills_per_run=6, seed=0, wall_s=600,
                   cpus=2, date='d', load_mean=7.5, load_max=12)
    report = bench.format_report([good, bad], summary)
    assert report.startswith('2 SIGKILLs over 2 runs')
    assert '**1 of 2 bit-identical**' in report
    assert '**1 corrupt loads**' in report
    assert ('| ddp | 2 | full, async_save | 1 | 0 | 0 | 1 (1 late) | 0 | 2 '
            '| 0 | 0 | yes |') in report
    assert ('| pp | 2 | full | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 1 | **no** |'
            in report)
    assert (good.failed, bad.failed) == (False, True)


def test_killer_waits_for_a_new_save_and_a_checkpoint_to_resume(tmp_path):
    killer = bench.Killer(None, '', str(tmp_path), 2, [], random.Random(0))
    # No checkpoint yet: a resume moment waits for the next other moment.
    planned = ['during-resume', 'during-resume', 'mid-save']
    assert killer.next_moment(planned) == 'mid-save'
    # A killed attempt's unfinished save is not a save in progress.
    (tmp_path / 'iter_3.tmp').mkdir()
    before = killer.save_tmps()
    assert killer.new_save_tmp(before) is None
    (tmp_path / 'iter_3.tmp').rmdir()
    (tmp_path / 'iter_3.tmp').mkdir()  # the next attempt's save of iter 3
    os.utime(tmp_path / 'iter_3.tmp', ns=(1, 1))  # a new ctime for sure
    assert killer.new_save_tmp(before) == 'iter_3.tmp'
    (tmp_path / 'iter_3').mkdir()
    assert killer.next_moment(planned) == 'during-resume'
    assert planned == ['during-resume']


def test_collective_check_needs_every_waiting_rank_to_stop_using_cpu():
    # Fake CPU clocks: rank pid 1 stops at once, pid 2 after 3 windows.
    clock = {1: iter([5, 5, 5, 5, 5, 5]), 2: iter([0, 10, 20, 30, 31, 31])}
    slept = []
    assert bench.wait_blocked([1, 2], ticks=lambda pid: next(clock[pid]),
                              sleep=slept.append, window_s=1.0)
    assert slept == [1.0] * 4  # not before pid 2 stopped
    busy = iter(range(0, 1000, 7))
    slept.clear()
    assert not bench.wait_blocked([3], ticks=lambda pid: next(busy),
                                  sleep=slept.append, window_s=1.0,
                                  timeout_s=5.0)
    assert len(slept) == 5

    def gone(pid):
        raise FileNotFoundError(pid)

    assert not bench.wait_blocked([4], ticks=gone, sleep=slept.append)
    assert bench.cpu_ticks(os.getpid()) > 0


def test_collective_kill_stops_one_rank_kills_a_waiting_one_resumes():
    procs = [subprocess.Popen(['sleep', '30']) for _ in range(2)]
    try:
        ranks = {0: procs[0].pid, 1: procs[1].pid}
        killer = bench.Killer(None, '', '', 2, [], random.Random(0))
        # Sleeping ranks use no CPU: blocked as if in a collective.
        assert killer.kill_in_collective(ranks, victim=1)
        assert procs[1].wait(5) == -9
        with open(f'/proc/{procs[0].pid}/stat') as file:
            state = file.read().rsplit(')', 1)[1].split()[0]
        assert state == 'S'  # continued, not left stopped
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_collective_kill_of_an_ended_attempt_kills_nothing():
    # The rank to stop has exited (the attempt ended meanwhile): None, the
    # campaign counts the moment missed instead of its thread dying.
    ended = subprocess.Popen(['true'])
    ended.wait()
    alive = subprocess.Popen(['sleep', '30'])
    try:
        killer = bench.Killer(None, '', '', 2, [], random.Random(0))
        assert killer.kill_in_collective(
            {0: ended.pid, 1: alive.pid}, victim=1) is None
        assert alive.poll() is None  # the victim was not killed
    finally:
        alive.kill()
        alive.wait()
