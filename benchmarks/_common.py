"""Plumbing the benchmark scripts share: spawning ranks, timing steps,
counting collectives, describing the machine, rewriting a docs section."""
import argparse
import contextlib
import datetime
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from typing import Callable, Iterator, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Gradient-reducing collectives, by the names torch.distributed exports
# (torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single; FSDP1
# and FSDP2 call whichever exists through the module attribute).
REDUCING_COLLECTIVES = ('all_reduce', 'reduce_scatter_single',
                        'reduce_scatter_tensor')


def spawn(run_rank: Callable, world_size: int, *args):
    """Run ``run_rank(rank, world_size, init_file, *args, queue)`` on
    ``world_size`` spawned processes; return what rank 0 put on the queue.

    A file:// rendezvous in a fresh temporary name: no fixed port.
    """
    fd, init_file = tempfile.mkstemp(prefix='mmpar_bench_')
    os.close(fd)
    os.unlink(init_file)
    queue = mp.get_context('spawn').SimpleQueue()
    try:
        mp.start_processes(run_rank,
                           args=(world_size, init_file, *args, queue),
                           nprocs=world_size, start_method='spawn')
    except mp.ProcessExitedException as exc:
        # A rank that dies after rank 0 reported (gloo has been seen to
        # abort at process exit, "terminate called without an active
        # exception") lost nothing that was measured: keep the result.
        if queue.empty():
            raise
        print(f'note: {exc} after rank 0 reported; result kept',
              file=sys.stderr)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    return queue.get()


def measure_on_ranks(measure: Callable, world_size: int, *args,
                     device: str = 'cpu'):
    """``measure(*args)`` on ``world_size`` spawned ranks (one thread each,
    gloo on CPU, nccl on CUDA); returns rank 0's result."""
    return spawn(_measure_rank, world_size, measure, device, args)


def _measure_rank(rank, world_size, init_file, measure, device, args,
                  queue) -> None:
    os.environ.update(OMP_NUM_THREADS='1', RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if device == 'cuda':
        torch.cuda.set_device(rank)
    dist.init_process_group(
        'nccl' if device == 'cuda' else 'gloo',
        init_method=f'file://{init_file}', rank=rank, world_size=world_size)
    try:
        result = measure(*args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def time_steps(step: Callable[[], object], num_steps: int) -> List[float]:
    """Seconds per call of ``step``, each started after a barrier so that
    every rank times the same step."""
    times = []
    for _ in range(num_steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def slowest_rank(values: List[float]) -> List[float]:
    """Element-wise max over ranks: a step is as slow as its slowest rank."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def median(values: List[float]) -> float:
    return statistics.median(values)


@contextlib.contextmanager
def counting_collectives() -> Iterator[List[Tuple[str, int]]]:
    """Record ``(name, bytes)`` for every gradient-reducing collective.

    Patches the ``torch.distributed`` functions in place. torch DDP reduces
    in C++ unless it has a Python comm hook: register
    ``default_hooks.allreduce_hook`` to make its calls visible here. The bytes
    are those of the largest tensor argument (the input of a reduce-scatter).
    """
    calls: List[Tuple[str, int]] = []
    originals = {
        name: getattr(dist, name)
        for name in REDUCING_COLLECTIVES if hasattr(dist, name)
    }

    def counting(name, function):

        def wrapped(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values())
                       if isinstance(a, torch.Tensor)]
            calls.append((name, max((t.numel() * t.element_size()
                                     for t in tensors), default=0)))
            return function(*args, **kwargs)

        return wrapped

    for name, function in originals.items():
        setattr(dist, name, counting(name, function))
    try:
        yield calls
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def _funcol_size(group) -> int:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(funcol._resolve_group_name(group)).size()


# name -> (kind, bound arguments -> the whole tensor's bytes, -> group size)
_FUNCOL = {
    'all_reduce': ('all_reduce', lambda a: _nbytes(a['self'])),
    'all_gather_single': ('all_gather', None),
    'all_gather_tensor': ('all_gather', None),
    'reduce_scatter_single': ('reduce_scatter', lambda a: _nbytes(a['self'])),
    'reduce_scatter_tensor': ('reduce_scatter', lambda a: _nbytes(a['self'])),
}
_C10D = {
    'all_reduce': ('all_reduce', lambda a: _nbytes(a['tensor'])),
    'all_gather_into_tensor': ('all_gather',
                               lambda a: _nbytes(a['output_tensor'])),
    # torch 2.13's names, which FSDP2 calls.
    'all_gather_single': ('all_gather',
                          lambda a: _nbytes(a['output_tensor'])),
    'all_gather': ('all_gather', lambda a: _nbytes(a['tensor_list'])),
    'reduce_scatter_tensor': ('reduce_scatter', lambda a: _nbytes(a['input'])),
    'reduce_scatter_single': ('reduce_scatter', lambda a: _nbytes(a['input'])),
    'broadcast': ('broadcast', lambda a: _nbytes(a['tensor'])),
}


@contextlib.contextmanager
def counting_all_collectives() -> Iterator[List[dict]]:
    """Record every collective, as ``dict(kind, full_bytes, group_size)``.

    Wraps the functions DTensor's redistributions call
    (``torch.distributed._functional_collectives``) and the
    ``torch.distributed`` ones (FSDP2, mmpar's wrappers and clip), only the
    outermost of nested calls counting. A dispatch mode would miss the
    collectives DTensor issues inside an op it is dispatching (a clip's norm
    of a ``Partial`` gradient, an optimizer step on one): a mode is off
    while its own handler runs. ``full_bytes`` is the size of the whole
    tensor (an all-gather's output, a reduce-scatter's input, an
    all-reduce's tensor); :func:`wire_bytes` turns it into what one rank
    sends.
    """
    import inspect

    from torch.distributed import _functional_collectives as funcol
    calls: List[dict] = []
    depth = [0]
    patched = []

    def wrap(module, name, kind, whole, group_size):
        function = getattr(module, name)
        signature = inspect.signature(function)

        def counted(*args, **kwargs):
            if depth[0] == 0:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                n = group_size(bound.arguments.get('group'))
                full = (whole(bound.arguments) if whole else
                        _nbytes(bound.arguments['self']) * n)
                calls.append(dict(kind=kind, full_bytes=full, group_size=n))
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        patched.append((module, name, function))
        setattr(module, name, counted)

    for name, (kind, whole) in _FUNCOL.items():
        wrap(funcol, name, kind, whole, _funcol_size)
    for name, (kind, whole) in _C10D.items():
        if hasattr(dist, name):
            wrap(dist, name, kind, whole, dist.get_world_size)
    try:
        yield calls
    finally:
        for module, name, function in patched:
            setattr(module, name, function)


def wire_bytes(call: dict) -> float:
    """Bytes one rank sends for a :func:`counting_all_collectives` call, ring
    algorithm: (n-1)/n of the whole tensor for an all-gather or a
    reduce-scatter, twice that for an all-reduce (reduce-scatter then
    all-gather), the whole tensor for anything else."""
    n = call['group_size']
    share = (n - 1) / n
    factor = dict(all_gather=share, reduce_scatter=share,
                  all_reduce=2 * share).get(call['kind'], 1.0)
    return factor * call['full_bytes']


def cpu_name() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            names = re.findall(r'model name\s*:\s*(.*)', f.read())
        if names:
            return names[0]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(backend: str, world_size: int) -> str:
    """The hardware and software a table was measured on, in one line."""
    gpu = (torch.cuda.get_device_name(0)
           if torch.cuda.is_available() else 'no GPU')
    return (f'{os.cpu_count()} CPU cores ({cpu_name()}), {gpu}; torch '
            f'{torch.__version__}, {backend}, {world_size} ranks x 1 thread')


def utc_now() -> str:
    return f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}'


def run_conditions(backend: str, world_size: int, start: float,
                   load_before: float) -> dict:
    """What a report states about its run: the machine, the date, the
    1-minute load average before (``load_before``) and now, and the seconds
    since ``start`` (``time.time()``)."""
    return dict(machine=machine_description(backend, world_size),
                date=utc_now(), load_before=load_before,
                load_after=os.getloadavg()[0], wall_s=time.time() - start)


def measured_section(title: str, out, world_size: int,
                     measure: Callable[[], list],
                     report: Callable[[list, dict], str]) -> str:
    """``report(measure(), conditions)`` (:func:`run_conditions` of the gloo
    run); written as the ``title`` section of ``out``/benchmarks.md when
    ``out`` is given; returned."""
    start, load_before = time.time(), os.getloadavg()[0]
    rows = measure()
    text = report(rows, run_conditions('gloo', world_size, start,
                                       load_before))
    if out:
        write_section(os.path.join(out, 'benchmarks.md'), title, text)
    return text


def write_section(path: str, title: str, body: str) -> None:
    """Replace the ``title`` section of the Markdown file ``path`` (up to the
    next ``## `` heading) with ``body``, or append it; other sections stay."""
    text = open(path).read() if os.path.exists(path) else '# Benchmarks\n'
    section = f'{title}\n\n{body}\n'
    pattern = re.compile(rf'^{re.escape(title)}\n.*?(?=^## |\Z)', re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + '\n', text).rstrip() + '\n'
    else:
        text = text.rstrip() + '\n\n' + section
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    with open(path, 'w') as f:
        f.write(text)


def section_main(doc: str, run: Callable, default_out: str,
                 steps_help: str) -> None:
    """The command line of a benchmark that rewrites one section:
    ``--quick``, ``--steps N``, ``--out DIR`` (``''``: print only); prints
    ``run(quick, out, steps)``."""
    parser = argparse.ArgumentParser(description=doc.split('\n')[0])
    parser.add_argument('--quick', action='store_true',
                        help='a tiny model, a step or two: a smoke run')
    parser.add_argument('--steps', type=int, default=0, help=steps_help)
    parser.add_argument('--out', default=default_out,
                        help='folder of benchmarks.md (its section is '
                        'rewritten); "" to print only')
    args = parser.parse_args()
    print(run(args.quick, args.out, args.steps))
