"""Fault campaign: SIGKILL a random rank at chosen moments, then check the
run ends bit-identical to its uninterrupted twin.

    PYTHONPATH=$PWD python benchmarks/bench_faults.py \
        [--layouts ddp fsdp2 tp_fsdp2 pp] [--kills-per-run 5] [--seed 0] \
        [--quick] [--out docs]

For each layout (a shipped config, made tiny and iteration-based, with a
checkpoint every few iterations) the twin runs once with
``bash tools/dist_train.sh CONFIG N``; then the same config runs in its own
work dir with ``MAX_RESTARTS=F`` (no ``--resume``: a restarted attempt
resumes by itself) while a killer SIGKILLs one rank process F times, each
at one of these moments of an attempt:

- ``mid-step``: a random delay after the attempt logged an iteration;
- ``mid-collective``: the same delay, then one rank is stopped (SIGSTOP)
  until the others' CPU time stops advancing (``/proc/PID/stat``: they are
  blocked in a collective waiting for it), one of those is SIGKILLed and the
  stopped one continued (SIGCONT); late if the others never blocked;
- ``mid-save``: as soon as a synchronous save's ``*.tmp`` file or directory
  appears (rank 0, which writes a full checkpoint and publishes either);
  the first save of a run is let through, so that later attempts have a
  checkpoint to resume from;
- ``mid-async-write``: the same, for ``async_save=True``, where the ``.tmp``
  exists while the background thread writes;
- ``during-resume``: a restarted attempt, as soon as it logs loading its
  checkpoint (counted late if it logged an iteration first).

Rank processes are the launcher's (torchrun's) children, found through
/proc, their rank read from their environment. Each run must exit 0 and
its last checkpoint must equal the twin's bit for bit: model weights,
optimizer state, schedulers, iteration and data position
(``meta['data_position']``). A "corrupt load" is any attempt's failure to
load a checkpoint (mmpar's "cannot load checkpoint" warning); there must be
none. Exits 1 if a run failed, differed or loaded a corrupt checkpoint.
"""
import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import utc_now, write_section  # noqa: E402
from benchmarks.bench_clean_exits import LoadSampler, launch_env  # noqa: E402

SECTION = '## Fault campaign: kill-anywhere restarts'
MOMENTS = ('mid-step', 'mid-collective', 'mid-save', 'mid-async-write',
           'during-resume')
#: mid-collective: the other ranks count as blocked in a collective once
#: their CPU time (utime + stime, in clock ticks) advanced at most this much
#: over BLOCKED_WINDOW_S; they wait for a rank that is stopped (SIGSTOP).
BLOCKED_TICKS = 1
BLOCKED_WINDOW_S = 1.0
BLOCKED_TIMEOUT_S = 30.0
ITERATION_LINE = re.compile(r'Iter\(train\)')
# What an attempt logs when it loads the checkpoint it resumes from.
RESUME_LINE = re.compile(
    r'Restart resumed|resumed epoch|Loads? checkpoint')
CORRUPT_LOAD = 'cannot load checkpoint'
SKIPPED = 'skipping checkpoint'
RUN_TIMEOUT_S = 1800
POLL_S = 0.002


@dataclass(frozen=True)
class Layout:
    """A shipped config, its ranks and how it checkpoints."""
    base: str
    nproc: int
    checkpoint_format: str
    async_save: bool
    extra: str = ''


LLAMA_TINY = '''model = dict(dim=32, num_layers=2, num_heads=4, max_seq_len=32)
context_length = 32
train_dataloader = dict(batch_size=4, dataset=dict(context_length=32,
                                                   num_windows=2000))
'''
LAYOUTS = {
    'ddp': Layout('configs/vit_digits/vit_digits.py', 2, 'full', True),
    'fsdp2': Layout('configs/vit_digits/vit_digits_fsdp2.py', 2, 'sharded',
                    True),
    'tp_fsdp2': Layout('configs/llama_shakespeare/llama_shakespeare_tp_fsdp2'
                       '.py', 4, 'sharded', False, LLAMA_TINY),
    'pp': Layout('configs/vit_digits/vit_digits_pp.py', 2, 'full', False),
}
TINY = '''_base_ = [{base!r}]
train_dataloader = dict(sampler=dict(type='InfiniteSampler', shuffle=True))
train_cfg = dict(_delete_=True, by_epoch=False, max_iters={iters})
val_dataloader = val_cfg = val_evaluator = None  # training state only
param_scheduler = [dict(type='ConstantLR', factor=1.0, by_epoch=False)]
default_hooks = dict(
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval={every},
                    max_keep_ckpts=-1, async_save={async_save}),
    logger=dict(interval=1))
custom_hooks = []
log_processor = dict(by_epoch=False)
checkpoint_format = {checkpoint_format!r}
{extra}'''


def write_config(folder: str, name: str, layout: Layout, iters: int,
                 every: int) -> str:
    """The tiny iteration-based config of ``layout``; returns its path."""
    path = os.path.join(folder, f'faults_{name}.py')
    with open(path, 'w') as f:
        f.write(TINY.format(base=os.path.join(ROOT, layout.base),
                            iters=iters, every=every,
                            async_save=layout.async_save,
                            checkpoint_format=layout.checkpoint_format,
                            extra=layout.extra))
    return path


def pick_moments(rng: random.Random, num_kills: int,
                 async_save: bool) -> List[str]:
    """``num_kills`` moments, each kind about equally often in random
    order; the first is never ``during-resume`` (the first attempt does not
    resume), and a layout saves either synchronously or asynchronously."""
    save = 'mid-async-write' if async_save else 'mid-save'
    kinds = ['mid-step', 'mid-collective', save, 'during-resume']
    moments = [kinds[i % len(kinds)] for i in range(num_kills)]
    rng.shuffle(moments)
    if moments and moments[0] == 'during-resume':
        swap = next((i for i, m in enumerate(moments) if m != moments[0]),
                    None)
        if swap is None:
            moments[0] = 'mid-step'
        else:
            moments[0], moments[swap] = moments[swap], moments[0]
    return moments


def cpu_ticks(pid: int) -> int:
    """The CPU time (user + system, clock ticks) of process ``pid`` from
    ``/proc/PID/stat`` (its fields 14 and 15, counted after the command
    name, which may hold spaces)."""
    with open(f'/proc/{pid}/stat') as file:
        fields = file.read().rsplit(')', 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_blocked(pids, ticks=cpu_ticks, sleep=time.sleep,
                 window_s: float = BLOCKED_WINDOW_S,
                 timeout_s: float = BLOCKED_TIMEOUT_S) -> bool:
    """Whether every process of ``pids`` stopped using the CPU (at most
    ``BLOCKED_TICKS`` over ``window_s``) within ``timeout_s``: what ranks
    blocked in a collective on a stopped peer do. False if one is gone."""
    waited = 0.0
    try:
        last = {pid: ticks(pid) for pid in pids}
        while waited < timeout_s:
            sleep(window_s)
            waited += window_s
            now = {pid: ticks(pid) for pid in pids}
            if all(now[pid] - last[pid] <= BLOCKED_TICKS for pid in pids):
                return True
            last = now
    except (FileNotFoundError, ProcessLookupError):
        pass
    return False


# --- comparing checkpoints -------------------------------------------------


def read_checkpoint(path: str) -> dict:
    """A full (``*.pth``) or sharded (directory) checkpoint, in this process
    with no process group, as one nested dict."""
    if os.path.isdir(path):
        from mmpar.checkpoint.sharded import sharded_to_full
        return sharded_to_full(path)
    return torch.load(path, map_location='cpu', weights_only=False)


def training_state(checkpoint: dict) -> dict:
    """What must survive a kill: weights, optimizer state, schedulers,
    iteration, epoch and data position."""
    meta = checkpoint.get('meta', {})
    return dict(state_dict=checkpoint['state_dict'],
                optimizer=checkpoint.get('optimizer'),
                param_schedulers=checkpoint.get('param_schedulers'),
                iter=meta.get('iter'), epoch=meta.get('epoch'),
                data_position=meta.get('data_position'))


def differences(a, b, path: str = '') -> List[str]:
    """Where ``a`` and ``b`` differ, bit for bit for tensors (dtype, shape
    and every value; NaNs equal where both have them)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
        return [] if same else [path or '.']
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f'{path} keys']
        return [d for k in a for d in differences(a[k], b[k], f'{path}/{k}')]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f'{path} length']
        return [d for i, (x, y) in enumerate(zip(a, b))
                for d in differences(x, y, f'{path}/{i}')]
    return [] if a == b else [path or '.']


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # Compare the bytes, so -0.0 != 0.0 and equal NaNs compare equal.
    tensor = tensor.detach().contiguous().cpu()
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor


# --- finding and killing ranks ---------------------------------------------


def rank_pids(launcher_pid: int) -> Dict[int, int]:
    """rank -> pid of the launcher's children that are ranks (their
    environment names RANK)."""
    ranks = {}
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat') as f:
                ppid = int(f.read().rsplit(')', 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f'/proc/{entry}/environ', 'rb') as f:
                env = dict(item.split(b'=', 1)
                           for item in f.read().split(b'\0') if b'=' in item)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if b'RANK' in env:
            ranks[int(env[b'RANK'])] = int(entry)
    return ranks


@dataclass
class Kill:
    moment: str
    rank: int
    at_s: float
    hit: bool  # the moment really was what it is named (see Killer)


@dataclass
class Killer:
    """Kills one rank per attempt at the planned moments, in a thread."""
    launcher: subprocess.Popen
    log_path: str
    work_dir: str
    nproc: int
    moments: List[str]
    rng: random.Random
    kills: List[Kill] = field(default_factory=list)
    missed: List[str] = field(default_factory=list)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _alive(self) -> bool:
        return self.launcher.poll() is None

    def _log(self, offset: int = 0) -> str:
        with open(self.log_path, errors='replace') as f:
            f.seek(offset)
            return f.read()

    def _attempt(self, old: set) -> Optional[Dict[int, int]]:
        """Wait for an attempt whose ranks are all up and none of ``old``."""
        while self._alive():
            ranks = rank_pids(self.launcher.pid)
            if len(ranks) == self.nproc and not old & set(ranks.values()):
                return ranks
            time.sleep(0.05)
        return None

    def save_tmps(self) -> Dict[str, tuple]:
        """The ``iter_*.tmp`` files and directories of unfinished saves,
        name -> (inode, creation time): a killed attempt's sharded
        ``.tmp`` stays until the next save of that name replaces it."""
        tmps = {}
        for name in os.listdir(self.work_dir):
            if name.startswith('iter_') and name.endswith('.tmp'):
                try:
                    stat = os.stat(os.path.join(self.work_dir, name))
                except OSError:
                    continue  # renamed meanwhile
                tmps[name] = (stat.st_ino, stat.st_ctime_ns)
        return tmps

    def new_save_tmp(self, before: Dict[str, tuple]) -> Optional[str]:
        return next((name for name, key in self.save_tmps().items()
                     if before.get(name) != key), None)

    def has_checkpoint(self) -> bool:
        return any(name.startswith('iter_') and not name.endswith('.tmp')
                   for name in os.listdir(self.work_dir))

    def _run(self) -> None:
        old: set = set()
        start = time.time()
        planned = list(self.moments)
        while planned:
            ranks = self._attempt(old)
            if ranks is None:
                self.missed.extend(planned)
                return
            old = set(ranks.values())
            offset = os.path.getsize(self.log_path)
            moment = self.next_moment(planned)
            before = self.save_tmps()
            rank, hit = self._wait_for(moment, ranks, offset, before)
            if rank is None:
                self.missed.append(moment)
                continue
            if moment == 'mid-collective':
                hit = self.kill_in_collective(ranks, rank)
                if hit is None:  # the attempt ended meanwhile
                    self.missed.append(moment)
                    continue
            else:
                saving = moment in ('mid-save', 'mid-async-write')
                # (Listed only for a save: a mid-step kill waits for nothing.)
                tmp = self.new_save_tmp(before) if saving else None
                try:
                    os.kill(ranks[rank], signal.SIGKILL)
                except ProcessLookupError:  # the attempt ended meanwhile
                    self.missed.append(moment)
                    continue
                if saving:
                    # Hit if the save had not completed: its .tmp is still
                    # there.
                    hit = tmp is not None and os.path.exists(
                        os.path.join(self.work_dir, tmp))
            self.kills.append(Kill(moment, rank, time.time() - start, hit))

    def kill_in_collective(self, ranks: Dict[int, int],
                           victim: int) -> Optional[bool]:
        """Stop another rank (SIGSTOP), wait until the others are blocked
        waiting for it, SIGKILL ``victim`` (one of them), then let the
        stopped one go on (SIGCONT); returns whether the wait held, or None
        when the rank to stop had already exited (nothing killed)."""
        stopped = (victim + 1 + self.rng.randrange(len(ranks) - 1)) % len(
            ranks)
        try:
            os.kill(ranks[stopped], signal.SIGSTOP)
        except ProcessLookupError:  # the attempt ended meanwhile
            return None
        try:
            waiting = [pid for r, pid in ranks.items() if r != stopped]
            hit = wait_blocked(waiting)
            try:
                os.kill(ranks[victim], signal.SIGKILL)
            except ProcessLookupError:  # the attempt ended meanwhile: late
                hit = False
        finally:
            try:
                os.kill(ranks[stopped], signal.SIGCONT)
            except ProcessLookupError:
                pass
        return hit

    def next_moment(self, planned: List[str]) -> str:
        """The next planned moment; a resume only once there is a
        checkpoint to resume from (else the next other moment first)."""
        index = 0
        if planned[0] == 'during-resume' and not self.has_checkpoint():
            index = next((i for i, m in enumerate(planned)
                          if m != 'during-resume'), 0)
        return planned.pop(index)

    def _wait_for(self, moment: str, ranks: Dict[int, int], offset: int,
                  before: Dict[str, tuple]):
        """Wait until ``moment`` in the attempt whose log starts at
        ``offset`` (a save: a ``.tmp`` not in ``before``); returns (rank to
        kill, hit) or (None, False) if the attempt ended first."""
        pids = set(ranks.values())

        def attempt_alive() -> bool:
            return self._alive() and pids <= set(
                rank_pids(self.launcher.pid).values())

        if moment in ('mid-step', 'mid-collective'):
            while attempt_alive():
                if ITERATION_LINE.search(self._log(offset)):
                    time.sleep(self.rng.uniform(0.0, 2.0))
                    return self.rng.randrange(self.nproc), True
                time.sleep(0.05)
        elif moment == 'during-resume':
            while attempt_alive():
                text = self._log(offset)
                # Late if the attempt had no checkpoint to load (it logs an
                # iteration first) or trained meanwhile.
                if RESUME_LINE.search(text) or ITERATION_LINE.search(text):
                    return (self.rng.randrange(self.nproc),
                            not ITERATION_LINE.search(self._log(offset)))
                time.sleep(POLL_S)
        else:
            checks = 0
            while self._alive():
                # The first save is let through: with no checkpoint to
                # resume from, no later attempt would resume.
                if (self.new_save_tmp(before) is not None
                        and self.has_checkpoint()):
                    return 0, True
                checks += 1
                if checks % 50 == 0 and not attempt_alive():
                    break
                time.sleep(POLL_S)
        return None, False


# --- one layout ------------------------------------------------------------


@dataclass
class LayoutResult:
    name: str
    nproc: int
    checkpoint_format: str
    async_save: bool
    twin_rc: object = None
    run_rc: object = None
    kills: List[Kill] = field(default_factory=list)
    missed: List[str] = field(default_factory=list)
    restarts: int = 0
    corrupt_loads: int = 0
    skipped: int = 0
    diffs: List[str] = field(default_factory=list)
    twin_s: float = 0.0
    run_s: float = 0.0
    tail: str = ''

    @property
    def identical(self) -> bool:
        return self.run_rc == 0 and self.twin_rc == 0 and not self.diffs

    @property
    def failed(self) -> bool:
        return not self.identical or self.corrupt_loads > 0


def launch(config: str, nproc: int, work_dir: str, log_path: str,
           restarts: int = 0) -> subprocess.Popen:
    env = launch_env()
    env['MAX_RESTARTS'] = str(restarts)
    with open(log_path, 'w') as log:
        return subprocess.Popen(
            ['bash', 'tools/dist_train.sh', config, str(nproc),
             '--work-dir', work_dir], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def wait(proc: subprocess.Popen) -> object:
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return 'timeout'


def last_checkpoint(work_dir: str, iters: int) -> str:
    name = os.path.join(work_dir, f'iter_{iters}')
    return name if os.path.isdir(name) else name + '.pth'


def run_layout(name: str, folder: str, num_kills: int, rng: random.Random,
               iters: int, every: int) -> LayoutResult:
    """The twin, then the killed run; compares their last checkpoints."""
    layout = LAYOUTS[name]
    result = LayoutResult(name, layout.nproc, layout.checkpoint_format,
                          layout.async_save)
    config = write_config(folder, name, layout, iters, every)
    twin_dir = os.path.join(folder, f'{name}_twin')
    run_dir = os.path.join(folder, f'{name}_killed')
    os.makedirs(run_dir)
    start = time.time()
    result.twin_rc = wait(launch(config, layout.nproc, twin_dir,
                                 twin_dir + '.log'))
    result.twin_s = time.time() - start
    moments = pick_moments(rng, num_kills, layout.async_save)
    start = time.time()
    proc = launch(config, layout.nproc, run_dir, run_dir + '.log', num_kills)
    killer = Killer(proc, run_dir + '.log', run_dir, layout.nproc, moments,
                    rng)
    thread = killer.start()
    result.run_rc = wait(proc)
    thread.join(timeout=60)
    result.run_s = time.time() - start
    result.kills, result.missed = killer.kills, killer.missed
    with open(run_dir + '.log', errors='replace') as f:
        output = f.read()
    result.restarts = output.count('Restart resumed')
    result.corrupt_loads = output.count(CORRUPT_LOAD)
    result.skipped = output.count(SKIPPED)
    result.tail = '\n'.join(output.splitlines()[-30:])
    if result.run_rc == 0 and result.twin_rc == 0:
        result.diffs = differences(
            training_state(read_checkpoint(last_checkpoint(twin_dir, iters))),
            training_state(read_checkpoint(last_checkpoint(run_dir, iters))))
    return result


# --- report ----------------------------------------------------------------


def print_result(result: LayoutResult) -> None:
    kills = ', '.join(f'{k.moment}@rank{k.rank}{"" if k.hit else "(late)"}'
                      for k in result.kills)
    print(f'{result.name} ({result.nproc} ranks, {result.checkpoint_format}'
          f'{", async" if result.async_save else ""}): twin rc '
          f'{result.twin_rc} ({result.twin_s:.0f} s), killed run rc '
          f'{result.run_rc} ({result.run_s:.0f} s); kills: {kills or "none"}'
          f'; missed: {result.missed or "none"}; restarts resumed '
          f'{result.restarts}; corrupt loads {result.corrupt_loads}; '
          f'bit-identical: {result.identical} {result.diffs[:5]}',
          flush=True)
    if result.run_rc != 0 or result.twin_rc != 0:
        print(result.tail, flush=True)


def format_report(results: List[LayoutResult], summary: dict) -> str:
    rows = ['| layout | ranks | checkpoints | ' + ' | '.join(MOMENTS) +
            ' | kills | restarts resumed | corrupt loads | bit-identical '
            '| wall (s) |',
            '|---|---|---|' + '---|' * len(MOMENTS) + '---|---|---|---|---|']
    for r in results:
        counts = [_moment_cell(r, m) for m in MOMENTS]
        rows.append(
            f'| {r.name} | {r.nproc} | {r.checkpoint_format}'
            f'{", async_save" if r.async_save else ""} | '
            + ' | '.join(counts) +
            f' | {len(r.kills)} | {r.restarts} | {r.corrupt_loads} | '
            f'{"yes" if r.identical else "**no**"} | '
            f'{r.twin_s:.0f} + {r.run_s:.0f} |')
    kills = sum(len(r.kills) for r in results)
    return '\n'.join([
        f'{kills} SIGKILLs over {len(results)} runs '
        f'({summary["iters"]} iterations each, a checkpoint every '
        f'{summary["every"]}; `MAX_RESTARTS` = kills planned per run, '
        f'{summary["kills_per_run"]}; seed {summary["seed"]}), each run '
        'compared with its uninterrupted twin: **'
        f'{sum(r.identical for r in results)} of {len(results)} '
        'bit-identical** (weights, optimizer state, schedulers, iteration, '
        f'data position), **{sum(r.corrupt_loads for r in results)} '
        'corrupt loads**.', '', *rows, '',
        'A cell counts the kills at that moment; "(n late)": n of them '
        'landed after the moment had passed (the save had already '
        'completed, or the resumed attempt had logged an iteration). Wall '
        'time: twin + killed run. '
        f'Total {summary["wall_s"] / 60:.1f} min on {summary["cpus"]} shared '
        f'CPU cores (gloo), 1-minute load average '
        f'{summary["load_mean"]:.1f} on average, {summary["load_max"]:.1f} '
        f'at most ({summary["date"]} UTC; '
        '`PYTHONPATH=$PWD python benchmarks/bench_faults.py`).'])


def _moment_cell(result: LayoutResult, moment: str) -> str:
    kills = [k for k in result.kills if k.moment == moment]
    late = sum(not k.hit for k in kills)
    return f'{len(kills)}' + (f' ({late} late)' if late else '')


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--layouts', nargs='+', default=list(LAYOUTS),
                        choices=list(LAYOUTS))
    parser.add_argument('--kills-per-run', type=int, default=6,
                        help='SIGKILLs per run (its MAX_RESTARTS)')
    parser.add_argument('--seed', type=int, default=0,
                        help='seeds the moments, delays and ranks')
    parser.add_argument('--iters', type=int, default=12)
    parser.add_argument('--every', type=int, default=3,
                        help='checkpoint every this many iterations')
    parser.add_argument('--quick', action='store_true',
                        help='one layout-size run: 2 kills, 6 iterations')
    parser.add_argument('--out', default='',
                        help='folder of benchmarks.md to write the summary '
                        'to ("" to print only)')
    args = parser.parse_args(argv)
    if args.quick:
        args.kills_per_run, args.iters, args.every = 2, 6, 2
    rng = random.Random(args.seed)
    sampler, start = LoadSampler(), time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix='mmpar_faults_') as folder:
        for name in args.layouts:
            results.append(run_layout(name, folder, args.kills_per_run, rng,
                                      args.iters, args.every))
            print_result(results[-1])
    summary = dict(iters=args.iters, every=args.every,
                   kills_per_run=args.kills_per_run, seed=args.seed,
                   wall_s=time.time() - start, cpus=os.cpu_count(),
                   date=utc_now(), **sampler.stop())
    report = format_report(results, summary)
    print(report)
    if args.out:
        write_section(os.path.join(args.out, 'benchmarks.md'), SECTION,
                      report)
    return 1 if any(r.failed for r in results) else 0


if __name__ == '__main__':
    sys.exit(main())
