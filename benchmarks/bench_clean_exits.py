"""Do finished runs exit 0? Many short jobs through the user's tools.

    PYTHONPATH=$PWD python benchmarks/bench_clean_exits.py \
        [--jobs 200] [--parallel 4] [--nproc 2 4] [--layouts ddp fsdp2 tp] \
        [--max-minutes M] [--busy 0] [--starve-gloo] [--out docs]

Each job trains the default example (``configs/vit_digits``, in the layout
named) for a few iterations with ``bash tools/dist_train.sh CONFIG N``,
validating and checkpointing at its last iteration, then evaluates that
checkpoint with ``bash tools/dist_test.sh CONFIG CHECKPOINT N``: exactly what
a user or a scheduler runs, with real interpreters (not the test suite's
fork server, whose children leave through ``os._exit`` and so skip the
interpreter's teardown, where the aborts at exit happened). ``--parallel``
jobs run at a time, so the machine is loaded the way a busy node is;
``--busy`` adds that many busy-looping processes on top.

``--starve-gloo`` reproduces the aborts at exit on demand: every rank runs on
CPU 0 with a busy loop, its gloo threads at ``SCHED_IDLE``
(``benchmarks/starve_gloo/sitecustomize.py``), so they finish their last
collective's bookkeeping late, as on a heavily loaded machine. Before the fix
in ``mmpar.failures.exit_process`` nearly every launch then died with
"terminate called without an active exception" at exit.

Prints one line per job, the tail of every launch that exited non-zero, and
the count; exits 1 if any launch did. With ``--out`` the summary is also
written as a section of ``OUT/benchmarks.md``.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import utc_now, write_section  # noqa: E402

SECTION = '## Clean exits: short train+test jobs through the tools'
# Layout name -> the shipped config it starts from.
LAYOUTS = {
    'ddp': 'configs/vit_digits/vit_digits.py',
    'fsdp1': 'configs/vit_digits/vit_digits_fsdp.py',
    'fsdp2': 'configs/vit_digits/vit_digits_fsdp2.py',
    'tp': 'configs/vit_digits/vit_digits_tp.py',
}
ITERS = 4
# The shipped config, made iteration-based and short: train ITERS
# iterations, then validate and save iter_{ITERS}.pth.
TINY = '''_base_ = [{base!r}]
train_dataloader = dict(sampler=dict(type='InfiniteSampler', shuffle=True))
train_cfg = dict(_delete_=True, by_epoch=False, max_iters={iters},
                 val_interval={iters})
param_scheduler = [dict(type='ConstantLR', factor=1.0, by_epoch=False)]
default_hooks = dict(checkpoint=dict(by_epoch=False, interval={iters}),
                     logger=dict(interval=1))
log_processor = dict(by_epoch=False)
'''
STARVE_GLOO = os.path.join(ROOT, 'benchmarks', 'starve_gloo')
STARVE_CPU = 0
TAIL_LINES = 30
# torchrun's line when a rank exited non-zero; its summary follows.
LAUNCHER_FAILED = 'failed (exitcode'
LAUNCH_TIMEOUT_S = 900


@dataclass
class Launch:
    """One tool invocation and how it ended."""
    argv: List[str]
    returncode: Optional[int] = None  # None: not run
    seconds: float = 0.0
    output: str = ''

    @property
    def failed(self) -> bool:
        return self.returncode not in (None, 0)

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The ranks' last ``lines`` lines before torchrun's failure report,
        then that report's exit codes."""
        text = self.output.rstrip().splitlines()
        report = next((i for i, line in enumerate(text)
                       if LAUNCHER_FAILED in line), len(text))
        codes = [line for line in text[report:]
                 if 'exitcode' in line or 'traceback :' in line]
        return '\n'.join(text[:report][-lines:] + codes)


@dataclass
class Job:
    index: int
    layout: str
    nproc: int
    launches: List[Launch] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(launch.failed for launch in self.launches)

    @property
    def name(self) -> str:
        return f'job {self.index} ({self.layout}, {self.nproc} ranks)'


def write_configs(folder: str, iters: int = ITERS) -> dict:
    """One tiny config per layout in ``folder``; layout -> path."""
    paths = {}
    for layout, base in LAYOUTS.items():
        path = os.path.join(folder, f'tiny_{layout}.py')
        with open(path, 'w') as f:
            f.write(TINY.format(base=os.path.join(ROOT, base), iters=iters))
        paths[layout] = path
    return paths


def plan_jobs(num_jobs: int, layouts: List[str], nprocs: List[int]) -> list:
    """``num_jobs`` jobs cycling through every (layout, nproc) pair."""
    pairs = [(layout, n) for n in nprocs for layout in layouts]
    return [Job(i, *pairs[i % len(pairs)]) for i in range(num_jobs)]


def launch_env(starve_gloo: bool = False) -> dict:
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    if starve_gloo:
        env['PYTHONPATH'] = STARVE_GLOO + os.pathsep + env['PYTHONPATH']
        env['STARVE_GLOO_CPU'] = str(STARVE_CPU)
    env['OMP_NUM_THREADS'] = '1'
    # A rank that aborts prints every Python thread's stack: the report
    # shows where it was.
    env['PYTHONFAULTHANDLER'] = '1'
    return env


def run_launch(argv: List[str], cwd: str,
               starve_gloo: bool = False) -> Launch:
    launch = Launch(argv)
    start = time.time()
    try:
        proc = subprocess.run(argv, cwd=cwd, env=launch_env(starve_gloo),
                              stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              errors='replace', timeout=LAUNCH_TIMEOUT_S)
        launch.returncode, launch.output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as err:
        launch.returncode = 'timeout'
        launch.output = (err.output or b'').decode(errors='replace')
    launch.seconds = time.time() - start
    return launch


def run_job(job: Job, configs: dict, folder: str,
            starve_gloo: bool = False) -> Job:
    """Train, then (if training exited 0) test the last checkpoint."""
    config = configs[job.layout]
    work_dir = os.path.join(folder, f'job_{job.index}')
    train = run_launch(['bash', 'tools/dist_train.sh', config,
                        str(job.nproc), '--work-dir', work_dir], ROOT,
                       starve_gloo)
    job.launches.append(train)
    checkpoint = os.path.join(work_dir, f'iter_{ITERS}.pth')
    if os.path.isfile(checkpoint):  # also after an abort at exit
        job.launches.append(run_launch(
            ['bash', 'tools/dist_test.sh', config, checkpoint,
             str(job.nproc), '--work-dir', work_dir], ROOT, starve_gloo))
    return job


class LoadSampler:
    """The 1-minute load average, sampled every few seconds."""

    def __init__(self, every_s: float = 5.0):
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s, ),
                                        daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        return dict(load_first=self.samples[0], load_last=self.samples[-1],
                    load_max=max(self.samples),
                    load_mean=sum(self.samples) / len(self.samples))


def busy_loops(count: int, cpu: Optional[int] = None) -> list:
    """``count`` processes that spin until killed (on CPU ``cpu`` only, if
    given)."""
    pin = f'import os; os.sched_setaffinity(0, {{{cpu}}})\n' \
        if cpu is not None else ''
    return [subprocess.Popen([sys.executable, '-c',
                              pin + 'while True: pass'])
            for _ in range(count)]


def run(num_jobs: int, parallel: int, layouts: List[str], nprocs: List[int],
        busy: int = 0, starve_gloo: bool = False,
        max_minutes: Optional[float] = None,
        folder: Optional[str] = None) -> dict:
    """Run the jobs; returns the summary (see :func:`format_report`). After
    ``max_minutes`` no further job starts (those running finish)."""
    jobs = plan_jobs(num_jobs, layouts, nprocs)
    with tempfile.TemporaryDirectory(prefix='mmpar_exits_',
                                     dir=folder) as tmp:
        configs = write_configs(tmp)
        spinners = busy_loops(busy)
        if starve_gloo:
            spinners += busy_loops(1, cpu=STARVE_CPU)
        sampler, start = LoadSampler(), time.time()
        deadline = start + 60 * max_minutes if max_minutes else None

        def run_in_time(job: Job) -> Job:
            if deadline is None or time.time() < deadline:
                run_job(job, configs, tmp, starve_gloo)
            return job

        try:
            with ThreadPoolExecutor(parallel) as pool:
                for job in pool.map(run_in_time, jobs):
                    if job.launches:
                        print_job(job)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        conditions = sampler.stop()
    launches = [launch for job in jobs for launch in job.launches]
    ran = [job for job in jobs if job.launches]
    return dict(jobs=ran, num_jobs=len(ran), planned_jobs=num_jobs,
                max_minutes=max_minutes, parallel=parallel,
                layouts=layouts, nprocs=nprocs, busy=busy,
                starve_gloo=starve_gloo,
                num_launches=len(launches),
                num_failed=sum(launch.failed for launch in launches),
                wall_s=time.time() - start, cpus=os.cpu_count(),
                date=utc_now(), **conditions)


def print_job(job: Job) -> None:
    codes = ', '.join(f'{os.path.basename(launch.argv[1])} '
                      f'{launch.returncode} ({launch.seconds:.0f} s)'
                      for launch in job.launches)
    print(f'{job.name}: {codes}', flush=True)
    for launch in job.launches:
        if launch.failed:
            print(f'--- {job.name}: {" ".join(launch.argv)} exited '
                  f'{launch.returncode}; the ranks\' last lines, then the '
                  f'exit codes torchrun reports:\n{launch.tail()}\n---',
                  flush=True)


def _conditions(summary: dict) -> str:
    text = f', with {summary["busy"]} busy loops' if summary['busy'] else ''
    return text + (', gloo threads starved' if summary['starve_gloo'] else
                   '')


def format_report(summary: dict) -> str:
    stopped = ''
    if summary['num_jobs'] < summary['planned_jobs']:
        stopped = (f' (of {summary["planned_jobs"]} planned: no job started '
                   f'after {summary["max_minutes"]:g} min)')
    return (
        f'{summary["num_jobs"]} jobs{stopped} '
        f'({", ".join(summary["layouts"])}; '
        f'{" and ".join(map(str, summary["nprocs"]))} ranks), each '
        f'`tools/dist_train.sh` ({ITERS} iterations, validation, checkpoint) '
        f'then `tools/dist_test.sh`, {summary["parallel"]} jobs at a time'
        f'{_conditions(summary)}'
        f' on {summary["cpus"]} CPU cores: **{summary["num_failed"]} of '
        f'{summary["num_launches"]} launches exited non-zero**. Wall time '
        f'{summary["wall_s"] / 60:.1f} min; 1-minute load average '
        f'{summary["load_mean"]:.1f} on average, {summary["load_max"]:.1f} '
        f'at most ({summary["date"]} UTC; '
        '`PYTHONPATH=$PWD python benchmarks/bench_clean_exits.py`).')


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--jobs', type=int, default=200,
                        help='how many train+test jobs')
    parser.add_argument('--parallel', type=int, default=4,
                        help='how many jobs run at a time')
    parser.add_argument('--nproc', type=int, nargs='+', default=[2, 4],
                        help='ranks per job; jobs cycle through these')
    parser.add_argument('--layouts', nargs='+', default=['ddp', 'fsdp2',
                                                         'tp'],
                        choices=sorted(LAYOUTS),
                        help='layouts; jobs cycle through these')
    parser.add_argument('--busy', type=int, default=0,
                        help='busy-looping processes to run alongside')
    parser.add_argument('--starve-gloo', action='store_true',
                        help='reproduce the aborts at exit: ranks on one '
                        'CPU with a busy loop, gloo threads at SCHED_IDLE')
    parser.add_argument('--max-minutes', type=float, default=None,
                        help='start no job after this many minutes')
    parser.add_argument('--out', default='',
                        help='folder of benchmarks.md to write the summary '
                        'to ("" to print only)')
    args = parser.parse_args(argv)
    summary = run(args.jobs, args.parallel, args.layouts, args.nproc,
                  args.busy, args.starve_gloo, args.max_minutes)
    report = format_report(summary)
    print(report)
    if args.out:
        write_section(os.path.join(args.out, 'benchmarks.md'), SECTION,
                      report)
    return 1 if summary['num_failed'] else 0


if __name__ == '__main__':
    sys.exit(main())
