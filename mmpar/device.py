"""The one place mmpar talks to the accelerator, through ``torch.accelerator``.

Device choice, synchronisation, memory statistics, RNG state and the
backend an accelerator's ranks use all go through here, so that CUDA, XPU,
MPS and the out-of-tree accelerators torch registers (HPU, NPU, ...) take
the same paths, and the CPU suite exercises them. No other module of mmpar
names ``torch.cuda`` (``tests/test_device.py`` keeps it so).

A process *uses* its accelerator when torch has one and, once a process
group exists, the group's backend is not gloo: ``env_cfg.dist_cfg.backend=
'gloo'`` on a GPU node trains on the CPU, as it always did.
"""
import functools
import gc
import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

CPU = 'cpu'
# The backend of each device type where torch does not say (older torch, or
# an accelerator registered out of tree without a default).
_FALLBACK_BACKENDS = {'cuda': 'nccl', 'xpu': 'xccl', CPU: 'gloo'}


def accelerator_type() -> Optional[str]:
    """The accelerator torch found (``'cuda'``, ``'xpu'``, ``'mps'`` ...),
    None on a machine without one."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def backend_for(device_type: str) -> str:
    """The collective backend for ``device_type`` (nccl for CUDA, xccl for
    XPU, gloo for the CPU and where torch names none)."""
    try:
        return dist.get_default_backend_for_device(device_type)
    except (RuntimeError, ValueError, AttributeError):
        return _FALLBACK_BACKENDS.get(device_type, 'gloo')


def default_backend() -> str:
    """The backend for this machine's accelerator, gloo without one."""
    return backend_for(accelerator_type() or CPU)


def backend_needs_accelerator(backend: str) -> bool:
    """Whether ``backend`` runs on an accelerator only (not gloo)."""
    return backend != 'gloo'


def uses_accelerator() -> bool:
    """Whether this process trains on its accelerator (see the module doc)."""
    if accelerator_type() is None:
        return False
    if dist.is_available() and dist.is_initialized():
        return backend_needs_accelerator(dist.get_backend())
    return True


def device_type() -> str:
    """``'cpu'`` or the accelerator's type, as :func:`uses_accelerator`."""
    return accelerator_type() if uses_accelerator() else CPU


def local_device(local_rank: Optional[int] = None) -> torch.device:
    """This rank's device: accelerator ``LOCAL_RANK`` (or ``local_rank``),
    else the CPU."""
    if not uses_accelerator():
        return torch.device(CPU)
    if local_rank is None:
        local_rank = int(os.environ.get('LOCAL_RANK', 0))
    return torch.device(device_type(), local_rank)


def current_device() -> torch.device:
    """The accelerator's current device (``cuda:3``), else the CPU."""
    if not uses_accelerator():
        return torch.device(CPU)
    return torch.device(device_type(),
                        torch.accelerator.current_device_index())


def set_device(local_rank: int) -> None:
    """Make accelerator ``local_rank`` this process's current device."""
    torch.accelerator.set_device_index(local_rank)


def synchronize() -> None:
    """Wait for the accelerator's queued work (nothing on the CPU)."""
    if uses_accelerator():
        torch.accelerator.synchronize()


def device_name() -> Optional[str]:
    """The accelerator's product name (``'NVIDIA H100 80GB HBM3'``), None
    on the CPU or where torch does not say."""
    kind = accelerator_type()
    if kind is None:
        return None
    get_name = getattr(torch.get_device_module(kind), 'get_device_name', None)
    return get_name() if get_name is not None else kind


# ---------------------------------------------------------------- memory
def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes; 0
    where the kernel does not say."""
    try:
        with open('/proc/self/status') as status:
            for line in status:
                if line.startswith(field + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def current_rss() -> int:
    """This process's resident memory in bytes (0 where unknown)."""
    return status_bytes('VmRSS')


def memory_in_use() -> int:
    """Bytes this rank holds now where training's memory lives: the
    accelerator's reserved memory (the caching allocator's), else the
    process's resident memory."""
    if uses_accelerator():
        return torch.accelerator.memory_reserved()
    return current_rss()


def peak_memory() -> Dict[str, int]:
    """Peak memory since the last :func:`reset_peak_memory`, bytes:
    ``allocated`` and ``reserved`` on an accelerator (``peak`` is the
    reserved one: what must fit), ``rss`` (``VmHWM``) on the CPU."""
    if uses_accelerator():
        allocated = torch.accelerator.max_memory_allocated()
        reserved = torch.accelerator.max_memory_reserved()
        return dict(peak=reserved, allocated=allocated, reserved=reserved)
    rss = status_bytes('VmHWM')
    return dict(peak=rss, rss=rss)


def release_memory() -> None:
    """Give freed memory back: collect garbage, empty the accelerator's
    cache, or ask glibc to return free heap pages (so that the next peak
    measured on the CPU is not the last one's leftovers)."""
    gc.collect()
    if uses_accelerator():
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
        return
    trim_heap()


# -------------------------------------------------- the CPU's heap (glibc)


@functools.lru_cache(maxsize=None)
def _glibc():
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c'))
        libc.malloc_trim  # glibc's
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def trim_heap() -> None:
    """Return glibc's free heap pages to the system (no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def reset_peak_memory() -> None:
    """Start a new peak: the accelerator's peak statistics, or the kernel's
    peak resident size (``VmHWM``, reset through ``/proc/self/clear_refs``,
    Linux 4.0 and later)."""
    if uses_accelerator():
        torch.accelerator.reset_peak_memory_stats()
        return
    try:
        with open('/proc/self/clear_refs', 'w') as refs:
            refs.write('5')
    except OSError:
        pass  # the peak then counts from the process's start


# ------------------------------------------------------------------- RNG
def rng_states() -> Dict[str, List[torch.Tensor]]:
    """Every device's generator state of the accelerator, once it is in
    use: ``{device type: [state per device]}`` (empty on the CPU)."""
    kind = accelerator_type()
    if kind is None:
        return {}
    module = torch.get_device_module(kind)
    is_initialized = getattr(module, 'is_initialized', lambda: True)
    if not is_initialized() or not hasattr(module, 'get_rng_state_all'):
        return {}
    return {kind: module.get_rng_state_all()}


def set_rng_states(states: Dict[str, List[torch.Tensor]]) -> None:
    """Restore what :func:`rng_states` returned, for the accelerator this
    machine has (states of another kind are ignored)."""
    kind = accelerator_type()
    if kind is None or kind not in states:
        return
    torch.get_device_module(kind).set_rng_state_all(states[kind])
