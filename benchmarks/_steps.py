"""What every benchmark's ranks share: building a step of a strategy,
driving it, and reading its memory (peak RSS, state bytes)."""
import copy
import ctypes
import gc
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.baselines import BASELINES


def read_status_kb(field: str) -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> Optional[int]:
    """Reset the process's peak RSS; return the current RSS (kB), or None
    where the kernel does not allow it (then no per-strategy peak)."""
    # Young generations only: a full collection costs ~0.2 s here, and the
    # tensors of a finished step are freed by reference counting anyway.
    gc.collect(1)
    try:
        # Hand freed heap pages back, so the next peak is not hidden in them.
        ctypes.CDLL('libc.so.6').malloc_trim(0)
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return read_status_kb('VmRSS')
    except OSError:
        return None


def peak_rss_since(rss_kb: Optional[int]) -> Optional[int]:
    """Bytes the peak RSS rose above ``rss_kb`` since :func:`reset_peak_rss`."""
    if rss_kb is None:
        return None
    return (read_status_kb('VmHWM') - rss_kb) * 1024


def model_state_bytes(optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state.

    Counts storages, each once: FSDP1's parameters are views into one flat
    shard, FSDP2's are DTensors whose local shards are counted (padding
    included: it is memory held).
    """
    from torch.distributed.tensor import DTensor

    seen = dict(params={}, grads={}, optimizer={})

    def add(kind, tensor):
        if tensor is None:
            return
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        seen[kind][(storage.data_ptr(), storage.nbytes())] = storage.nbytes()

    for group in optimizer.param_groups:
        for param in group['params']:
            add('params', param)
            add('grads', param.grad)
            for value in optimizer.state.get(param, {}).values():
                if torch.is_tensor(value):
                    add('optimizer', value)
    return {kind: sum(sizes.values()) for kind, sizes in seen.items()}


class MMStep:
    """An mmpar wrapper driven as MMEngine's train loop drives it."""

    def __init__(self, wrapper, optim_wrapper):
        self.wrapper = wrapper
        self.optim_wrapper = optim_wrapper
        self.optimizer = optim_wrapper.optimizer
        self.keep_grads = False

    def step(self, batch: dict) -> None:
        if not self.keep_grads:
            self.wrapper.train_step(batch, self.optim_wrapper)
            return
        # train_step's body without the zero_grad that ends it, so that the
        # gradients can be read.
        optim_wrapper = self.optim_wrapper
        with optim_wrapper.grad_sync_context():
            self.wrapper.forward_backward(batch, optim_wrapper)
        if optim_wrapper.should_update():
            optim_wrapper.step()


def build_model(model_cfg: dict, device):
    from mmpar.registry import MODELS
    torch.manual_seed(0)  # every strategy starts from the same weights
    return MODELS.build(copy.deepcopy(model_cfg)).to(device)


def build_step(model_cfg: dict, wrapper_cfg: Optional[dict], optim_cfg: dict,
               device):
    """A step of ``wrapper_cfg`` (a baseline, or an mmpar wrapper over the
    whole world with mmpar's optim wrapper, as the Runner builds them)."""
    from mmengine.optim import build_optim_wrapper

    from mmpar.runner.optim import mmpar_optim_wrapper_cfg
    from mmpar.wrappers.builder import build_model_wrapper
    model = build_model(model_cfg, device)
    if 'baseline' in wrapper_cfg:
        return BASELINES[wrapper_cfg['baseline']](model, optim_cfg, device)
    wrapper = build_model_wrapper(wrapper_cfg, model)
    # After wrapping: FSDP2 replaces the parameters with sharded ones.
    return MMStep(wrapper, build_optim_wrapper(
        wrapper, mmpar_optim_wrapper_cfg(copy.deepcopy(optim_cfg))))


def make_batches(rank: int, world_size: int, batch_size: int, num: int,
                 device) -> List[dict]:
    """``num`` distinct batches of the training digits for this rank."""
    from mmpar.datasets.digits import DigitsDataset
    data = DigitsDataset('train')
    batches = []
    for i in range(num):
        start = (i * world_size + rank) * batch_size % (len(data) -
                                                        batch_size)
        index = slice(start, start + batch_size)
        batches.append(dict(inputs=data.images[index].unsqueeze(1).to(device),
                            data_samples=data.labels[index].to(device)))
    return batches


def cycling(step: Callable[[dict], None], batches: List[dict]):
    state = dict(i=0)

    def run():
        step(batches[state['i'] % len(batches)])
        state['i'] += 1

    return run


def log(message: str) -> None:
    """Progress on stderr, rank 0 only (the report goes to stdout)."""
    if dist.get_rank() == 0:
        print(f'[{time.strftime("%H:%M:%S")}] {message}', file=sys.stderr,
              flush=True)
