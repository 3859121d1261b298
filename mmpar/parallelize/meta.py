"""Build a model without materialising it, then fill only this rank's share.

Layouts that shard or split a model (FSDP1/FSDP2/HSDP, tensor and pipeline
parallelism) need not hold it whole on any rank. The Runner builds such a
model with :func:`build_on_meta`: its constructor (and ``init_weights``)
runs as usual, but every *parameter* lives on the meta device (no memory)
while buffers stay real (they are small and often computed, e.g. rotary
tables). Each initialisation op on a parameter is recorded: which op, on
which parameter (or part of it), with which arguments, and for a random op
the CPU generator's state just before it. The op also runs on a throw-away
tensor of the parameter's shape, so the generator advances exactly as in a
one-process build and everything drawn later (data order, dropout) agrees.

The meta model is then parallelised as usual (TP, PP split, activation
checkpointing, compile, FSDP): meta parameters cost nothing to split or
copy. :meth:`MetaInit.materialize` allocates only this rank's local shards
(``to_empty``) and fills each parameter in turn: it replays that parameter's
ops on a whole tensor of its shape, from its last complete overwrite (an op
such as ``normal_`` or ``fill_`` that does not read the old value),
restoring the generator state each random op had, and keeps this rank's
part (``distribute_tensor(..., src_data_rank=None)``: no communication).
So the weights equal a one-process build from the same seed, bit for bit,
while a rank holds its shards plus one whole parameter at a time.

What a model must do to be built this way: initialise parameters with
in-place ops on them (``torch.nn.init``, MMEngine's ``init_cfg`` and weight
initialisers, ``param.data.normal_()``, ``param.copy_(real tensor)``, a
tensor given to ``nn.Parameter``), not by computing from other parameters'
values. A model that does anything else is refused with an error naming the
parameter and the switch ``meta_init=False`` (build whole on every rank).
"""
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import \
    register_module_parameter_registration_hook
# Private module: torch 2.13 has no public home for TorchDispatchMode.
from torch.utils._python_dispatch import TorchDispatchMode

from mmpar import device
from mmpar.failures import ConfigError

KEY = 'meta_init'
aten = torch.ops.aten
# In-place ops that draw from a generator; each overwrites its target.
RANDOM_OPS = {
    aten.uniform_, aten.normal_, aten.bernoulli_, aten.random_,
    aten.exponential_, aten.geometric_, aten.cauchy_, aten.log_normal_
}
# Other in-place ops that overwrite their target without reading it.
OVERWRITE_OPS = {aten.fill_, aten.zero_, aten.copy_}
# Ops that make a new tensor from shapes or from a real one: while a model
# is built they run on the CPU even when asked for the meta device (a
# parameter's device), so buffers and temporaries keep real values and
# random draws happen as in a one-process build.
FACTORY_NAMES = ('empty', 'empty_strided', 'zeros', 'ones', 'full', 'rand',
                 'randn', 'randint', 'randperm', 'arange', 'linspace',
                 'logspace', 'eye', 'scalar_tensor', 'normal', '_to_copy')
CPU = torch.device('cpu')


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (views share it)."""
    # data_ptr() is 0 for every meta tensor. torch keeps one Python object
    # per storage for the storage's lifetime (its views return the same),
    # so its id is the storage's identity while the tensor lives.
    return id(tensor.untyped_storage())


def _is_factory(func) -> bool:
    name = func.overloadpacket.__name__
    return (name in FACTORY_NAMES or name.startswith('new_') or
            name.endswith('_like'))


def _stop(name: str, why: str) -> ConfigError:
    return ConfigError(
        f'parameter {name!r} cannot be built on the meta device: {why}; '
        f'allowed: set {KEY}=False in the config to build the model whole '
        'on every rank (it is then initialised before sharding)')


# torch.nn.init functions that return at once for a meta tensor (no op
# reaches the recorder, no random draw is made) and, for trunc_normal_,
# draw a data-dependent number of times (rejection sampling): they are
# recorded whole, as one call, while a model is built.
WHOLE_INIT_FUNCTIONS = ('_no_grad_trunc_normal_', 'orthogonal_', 'dirac_',
                        'sparse_')


@dataclass
class _Op:
    func: Any  # an aten OpOverload, or one of WHOLE_INIT_FUNCTIONS
    args: tuple  # the target replaced by None; other tensors real
    kwargs: dict
    view: Optional[Tuple[tuple, tuple, int]]  # size, stride, offset; None: whole
    rng_state: Optional[torch.Tensor]  # CPU generator before a random op

    def overwrites(self) -> bool:
        if self.view is not None:
            return False
        packet = getattr(self.func, 'overloadpacket', None)
        return packet is None or packet in RANDOM_OPS or \
            packet in OVERWRITE_OPS


@dataclass
class _Record:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    initial: Optional[torch.Tensor]  # the tensor nn.Parameter was given
    ops: List[_Op] = field(default_factory=list)
    unsupported: Optional[str] = None

    def add(self, op: _Op) -> None:
        if op.overwrites():
            # Earlier ops (and the tensor nn.Parameter was given) no longer
            # matter: keep only from here.
            self.ops.clear()
            self.initial = None
        self.ops.append(op)


class _Recorder(TorchDispatchMode):
    """Records in-place ops on meta parameters (by storage); runs random
    ones on a real tensor too, so the generator advances as it would."""

    def __init__(self, draw: bool = True):
        super().__init__()
        self.records: Dict[int, _Record] = {}  # meta storage -> record
        self.passthrough = False  # while a parameter moves to meta
        # False: random ops are recorded without their draw (shapes only:
        # the generator does not advance and nothing can be materialised).
        self.draw = draw

    def track(self, param: torch.Tensor, initial: torch.Tensor) -> None:
        self.records[storage_key(param)] = _Record(
            tuple(param.shape), param.dtype, initial)

    def _record_of(self, value) -> Optional[_Record]:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self.records.get(storage_key(value))
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.passthrough:
            return func(*args, **kwargs)
        if _is_factory(func):
            return self._on_cpu(func, args, kwargs)
        target = args[0] if args else None
        record = self._record_of(target)
        # torch.Tag.inplace: the op writes its first argument and returns it
        # (aten's in-place ops carry it; torch.library asks it of custom
        # ops that do so).
        if record is not None and torch.Tag.inplace in func.tags:
            self._record(func, target, record, args, kwargs)
        else:
            # Another tensor computed from a parameter's (unknown) value,
            # then written into a parameter, cannot be replayed: mark it.
            for value in list(args[1:]) + list(kwargs.values()):
                source = self._record_of(value)
                if source is not None and record is not None:
                    record.unsupported = f'{func} reads another parameter'
        return func(*args, **kwargs)

    @staticmethod
    def _on_cpu(func, args, kwargs):
        # A factory asked for the meta device, or a *_like / new_* of a meta
        # tensor (which would inherit its device): on the CPU instead.
        kwargs = dict(kwargs)
        if func.overloadpacket is aten._to_copy and args[0].is_meta:
            # A parameter's value read out (MMEngine's init_weights logs
            # means): unknown here, so NaN; a parameter computed from it is
            # refused when materialised (MetaInit.value).
            meta = args[0]
            dtype = kwargs.get('dtype') or meta.dtype
            out = torch.empty(meta.shape, dtype=dtype)
            return out.fill_(float('nan')) if out.is_floating_point() \
                else out.zero_()
        device = kwargs.get('device')
        # (A _to_copy of a meta tensor returned above.)
        inherits = args and isinstance(args[0], torch.Tensor) and \
            args[0].is_meta
        if (device is not None and torch.device(device).type == 'meta') or \
                (device is None and inherits):
            kwargs['device'] = CPU
        if inherits:
            # Only the shape, dtype and layout of a meta input are read.
            meta = args[0]
            real = torch.empty(0, dtype=meta.dtype) \
                if func.overloadpacket.__name__.startswith('new_') else \
                torch.empty_strided(meta.shape, meta.stride(),
                                    dtype=meta.dtype)
            args = (real, ) + tuple(args[1:])
        return func(*args, **kwargs)

    def record_call(self, function: Callable, target: torch.Tensor,
                    args: tuple, kwargs: dict) -> bool:
        """Record a whole init function applied to a meta parameter (and
        run it on a real tensor of its shape, for the generator). False: the
        target is no meta parameter."""
        record = self._record_of(target)
        if record is None:
            return False
        state = torch.get_rng_state()
        if self.draw:
            self.passthrough = True
            try:
                function(torch.empty(target.shape, dtype=target.dtype),
                         *args, **kwargs)
            finally:
                self.passthrough = False
        view = None if tuple(target.shape) == record.shape else (
            tuple(target.shape), target.stride(), target.storage_offset())
        record.add(_Op(function, (None, ) + tuple(args), dict(kwargs), view,
                       state))
        return True

    def _record(self, func, target, record, args, kwargs) -> None:
        others = [a for a in list(args[1:]) + list(kwargs.values())
                  if isinstance(a, torch.Tensor)]
        if any(a.is_meta for a in others):
            record.unsupported = (f'{func} reads a meta tensor (a value '
                                  'computed from parameters)')
            return
        whole = (tuple(target.shape) == record.shape and
                 target.storage_offset() == 0 and target.is_contiguous())
        view = None if whole else (tuple(target.shape), target.stride(),
                                   target.storage_offset())
        random = func.overloadpacket in RANDOM_OPS
        state = None
        if random:
            generator = kwargs.get('generator')
            if generator is not None:
                record.unsupported = f'{func} with its own generator'
                return
            state = torch.get_rng_state()
            if self.draw:
                # The draw a one-process build makes: the same op on a real
                # tensor of the same shape (then dropped).
                real = torch.empty(target.shape, dtype=target.dtype)
                func(real, *args[1:], **kwargs)
                del real
        record.add(_Op(func, (None, ) + tuple(args[1:]), dict(kwargs), view,
                       state))


@contextlib.contextmanager
def _parameters_on_meta(recorder: _Recorder) -> Iterator[None]:
    """Every parameter registered in the block, by this thread, lives on
    the meta device (buffers do not); the tensor it was given is kept until
    an op overwrites it (a zeros token that nothing re-initialises keeps
    it). Other threads (a data-loader or logging thread running meanwhile)
    register theirs as torch does."""
    builder = threading.get_ident()

    def register_on_meta(module, name, param):
        if param is None or param.is_meta or \
                threading.get_ident() != builder:
            return None  # registered as torch registers it
        initial = param.detach()
        recorder.passthrough = True
        try:
            param = nn.Parameter(param.to('meta'),
                                 requires_grad=param.requires_grad)
        finally:
            recorder.passthrough = False
        recorder.track(param, initial)
        return param

    def whole(function):

        def call(tensor, *args, **kwargs):
            if recorder.record_call(function, tensor, args, kwargs):
                return tensor
            return function(tensor, *args, **kwargs)

        return call

    init = torch.nn.init
    saved = {name: getattr(init, name) for name in WHOLE_INIT_FUNCTIONS}
    # Every parameter as it is registered: torch's public global
    # registration hook (it may return a replacement), removed on exit.
    # The init functions that skip meta tensors have no hook or override
    # (no __torch_function__ handling in torch 2.13): replaced for the
    # block, as Accelerate's init_empty_weights does.
    hook = register_module_parameter_registration_hook(register_on_meta)
    for name, function in saved.items():
        setattr(init, name, whole(function))
    try:
        yield
    finally:
        hook.remove()
        for name, function in saved.items():
            setattr(init, name, function)


@contextlib.contextmanager
def _temporaries_returned() -> Iterator[None]:
    """Free heap goes back to the system after the block (glibc's
    ``malloc_trim``; a no-op where the C library is not glibc).

    mmpar does not tune the allocator. glibc raises its mmap threshold to
    the largest block freed so far (up to 32 MiB); larger allocations then
    come from the heap, whose freed space fragments and is not returned.
    Measured: building a 100 M-parameter Llama one temporary parameter at a
    time reached 565 MB of RSS that way, 49 MB with the threshold fixed at
    1 MiB. A CPU user who builds big models sets it for the ranks,
    ``MALLOC_MMAP_THRESHOLD_=1048576`` (docs/big_models.md).
    """
    try:
        yield
    finally:
        device.trim_heap()


@dataclass
class MetaInit:
    """What :func:`build_on_meta` recorded: each parameter's initialisation,
    by its name in the plain model."""
    records: Dict[str, _Record]

    def value(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s whole initial value (CPU), as a one-process
        build gives it; the generator is left as it was.

        Raises:
            ConfigError: its initialisation cannot be replayed.
        """
        record = self.records.get(name)
        if record is None:
            raise _stop(name, 'it was not registered while the model was '
                        'built (made after construction?)')
        if record.unsupported:
            raise _stop(name, record.unsupported)
        full = (record.initial.clone() if record.initial is not None else
                torch.empty(record.shape, dtype=record.dtype))
        saved = torch.get_rng_state()
        try:
            for op in record.ops:
                target = full if op.view is None else full.as_strided(
                    *op.view)
                if op.rng_state is not None:
                    torch.set_rng_state(op.rng_state)
                op.func(target, *op.args[1:], **op.kwargs)
        finally:
            torch.set_rng_state(saved)
        if full.is_floating_point() and torch.isnan(full).any():
            raise _stop(name, 'its initialisation read parameter values, '
                        'which are unknown on the meta device')
        return full

    def record_init_weights(self, model: nn.Module) -> List[str]:
        """Run ``model.init_weights()`` now, adding its ops to the records.

        ``model`` is a copy of the meta model :func:`build_on_meta` built
        with ``init_weights=False`` (parameter names as the records'). Run
        where MMEngine's ``Runner.train()`` runs ``init_weights``, its
        random ops see the generator state one process's see, and draw as
        they do, so the generator is left where one process leaves it.

        Returns:
            The names of the parameters it changed (:meth:`value` now gives
            their initialised value; rank 0's generator states, as
            :func:`build_on_meta` keeps).

        Raises:
            ConfigError: ``init_weights`` fails on the meta device, naming
                the switch ``meta_init=False``.
        """
        if not hasattr(model, 'init_weights'):
            return []
        recorder = _Recorder()
        for name, param in model.named_parameters(remove_duplicate=False):
            record = self.records.get(name)
            if record is not None and param.is_meta:
                recorder.records[storage_key(param)] = record
        before = {id(r): (r.initial, list(r.ops), r.unsupported)
                  for r in self.records.values()}
        try:
            with _temporaries_returned(), _parameters_on_meta(recorder), \
                    recorder:
                model.init_weights()
        except Exception as err:  # noqa: B902 - any failure on meta
            raise ConfigError(
                f'init_weights() cannot run on the meta device '
                f'({type(err).__name__}: {err}); allowed: set {KEY}=False '
                'in the config to build the model whole on every rank') \
                from err

        def changed(record: _Record) -> bool:
            initial, ops, unsupported = before[id(record)]
            return (record.initial is not initial or
                    record.unsupported != unsupported or
                    len(record.ops) != len(ops) or
                    any(a is not b for a, b in zip(record.ops, ops)))

        names = [n for n, r in self.records.items() if changed(r)]
        _use_rank0_states({n: self.records[n] for n in names})
        return names

    def fill(self, named_params: Iterator[Tuple[str, nn.Parameter]]) -> None:
        """Give each (materialised, possibly sharded) parameter its value:
        this rank's part of the whole one (no communication)."""
        with torch.no_grad():
            for name, param in named_params:
                full = self.value(name)
                if isinstance(param, DTensor):
                    local = distribute_tensor(
                        full, param.device_mesh, param.placements,
                        src_data_rank=None).to_local()
                    param.to_local().copy_(local)
                else:
                    param.copy_(full)
                del full

    def materialize(self, module: nn.Module,
                    device: torch.device) -> nn.Module:
        """Allocate ``module``'s meta parameters on ``device`` (only local
        shards) and fill them; buffers keep their values."""
        with _temporaries_returned():
            _to_empty_keeping_buffers(module, device, recurse=True)
            self.fill(module.named_parameters())
        return module

    def module_initializer(self, root: nn.Module,
                           device: torch.device) -> Callable:
        """``param_init_fn`` for FSDP1, which materialises one module at a
        time before flattening (names are looked up in ``root``, the plain
        model)."""
        names = {id(m): n for n, m in root.named_modules()}

        def init(module: nn.Module) -> None:
            prefix = names[id(module)]
            own = [(f'{prefix}.{n}' if prefix else n, p)
                   for n, p in module.named_parameters(recurse=False)]
            with _temporaries_returned():
                _to_empty_keeping_buffers(module, device, recurse=False)
                self.fill((n, module.get_parameter(n.rpartition('.')[2]))
                          for n, _ in own)

        return init


def _to_empty_keeping_buffers(module: nn.Module, device: torch.device,
                              recurse: bool) -> None:
    buffers = {n: b.detach().clone()
               for n, b in module.named_buffers(recurse=recurse)}
    module.to_empty(device=device, recurse=recurse)
    with torch.no_grad():
        for name, buffer in module.named_buffers(recurse=recurse):
            buffer.copy_(buffers[name])


def _build_error(err: Exception) -> ConfigError:
    """What a failed build says: a meta-device limit only when torch's
    error is about the meta device (a value read, an op without a meta
    kernel); anything else is the model's own error, which building whole
    would raise too."""
    what = f'{type(err).__name__}: {err}'
    if 'meta' in str(err).lower() or isinstance(err, NotImplementedError):
        return ConfigError(
            f'the model cannot be built on the meta device ({what}); '
            f'allowed: set {KEY}=False in the config to build it whole on '
            'every rank')
    return ConfigError(
        f'the model cannot be built ({what}); check the model section of '
        f'the config (it was being built on the meta device, {KEY}=True, '
        'which does not change this error)')


def build_on_meta(build: Callable[[], nn.Module],
                  init_weights: bool = True,
                  rank0_states: bool = True,
                  shapes_only: bool = False) -> Tuple[nn.Module, MetaInit]:
    """``build()`` with parameters on the meta device, recording how each is
    initialised (then ``init_weights()``, as MMEngine's Runner runs it).

    Every rank records; with ``rank0_states`` the generator states are
    rank 0's (broadcast: a collective), so ranks seeded differently still
    agree, as the broadcast after a whole build made them. ``shapes_only``
    skips the random draws that leave the generator where a real build
    leaves it (seconds per GB of parameters): for a model that is only
    inspected, never materialised (the plan tool).

    Raises:
        ConfigError: the constructor fails on the meta device, naming the
            switch ``meta_init=False``.
    """
    recorder = _Recorder(draw=not shapes_only)
    try:
        with _temporaries_returned(), _parameters_on_meta(recorder), recorder:
            model = build()
            if init_weights and hasattr(model, 'init_weights'):
                model.init_weights()
    except ConfigError:
        raise
    except Exception as err:  # noqa: B902 - any failure on meta
        raise _build_error(err) from err
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ConfigError(
            f'buffer {meta_buffers[0]!r} was made on the meta device while '
            f'the model was built; allowed: set {KEY}=False in the config to '
            'build the model whole on every rank')
    by_storage = recorder.records
    records = {
        name: by_storage[storage_key(param)]
        for name, param in model.named_parameters(remove_duplicate=False)
        if param.is_meta and storage_key(param) in by_storage
    }
    if rank0_states:
        _use_rank0_states(records)
    return model, MetaInit(records)


def _use_rank0_states(records: Dict[str, _Record]) -> None:
    if not (dist.is_available() and dist.is_initialized() and
            dist.get_world_size() > 1):
        return
    names = sorted(records)
    states = [[op.rng_state for op in records[n].ops] for n in names]
    box = [states if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    for name, ops_states in zip(names, box[0]):
        for op, state in zip(records[name].ops, ops_states):
            op.rng_state = state
