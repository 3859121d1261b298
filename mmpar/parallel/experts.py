"""Routed tokens to the ranks that hold their experts, and back.

Under expert parallelism (``parallel.ep``) the experts of an MoE layer are
split over the ``ep`` ranks of an expert group: rank ``j`` holds experts
``j * E/ep .. (j+1) * E/ep - 1``. A layer's routed tokens, sorted by
expert, are sent with one ``all_to_all_single`` to the ranks of their
experts (:func:`dispatch`), computed there, and sent back with another
(:func:`combine`). Both go through ``torch.distributed.nn.functional``'s
``all_to_all_single``, whose backward is the reverse all-to-all, so the
gradients of the routed tokens flow back to the ranks that sent them (gloo
and nccl both have it).

The expert-parallel protocol (docs/expert_parallel.md), which mmpar's
:class:`~mmpar.models.moe.GroupedExperts` and a user's own experts module
meet alike:

- the module declares ``expert_parallel_params``, the names of its
  parameters stacked over its experts on dim 0 (every one the same length
  ``E`` on dim 0), and has no other parameters;
- its ``forward(routed, counts, *rest)`` takes the routed token copies
  ``(N, dim)`` sorted by expert and ``counts`` ``(E,)``, the rows of each
  expert, and returns one output row per input row in the same order,
  computing expert ``e``'s rows with entry ``e`` of the stacked weights it
  holds (read through :func:`local_experts`: under ep, ``E/ep`` of them,
  and ``counts`` then has ``E/ep`` entries).

Under ep mmpar splits the stacked parameters on dim 0 over the ep ranks
and hooks the forward: :func:`dispatch` before it, :func:`combine` after
it; the module itself knows nothing of ep.

A module whose forward takes something else (Hugging Face's experts take
the tokens and their top-k choices, and sort inside) meets the protocol's
second form instead: it declares ``expert_parallel_group = None`` and
passes its tokens, sorted by expert, through :func:`run_local_experts`;
mmpar then sets that attribute to the ep group rather than hooking the
forward.
"""
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class SharedGroup:
    """A process group a module holds, which the module's deep copies
    share: a pipeline stage is cut from a copy of the model, and a process
    group cannot be copied (the copy runs on the same ranks).

    Attributes:
        group: the process group.
    """
    group: dist.ProcessGroup

    def __deepcopy__(self, memo: dict) -> 'SharedGroup':
        return self


@dataclass(frozen=True)
class ExpertGroup(SharedGroup):
    """The ranks one layer's experts are split over; shared, not copied,
    by a deep copy of the module holding it (a :class:`SharedGroup`).

    Attributes:
        group: the ep process group.
        size: its number of ranks (``parallel.ep``).
    """
    size: int


@dataclass(frozen=True)
class Dispatched:
    """What :func:`combine` needs to send computed tokens back.

    Attributes:
        order: the received tokens' positions, grouped by local expert.
        send_splits: tokens this rank sent to each rank of the group.
        recv_splits: tokens this rank received from each.
    """
    order: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]


def dispatch(routed: torch.Tensor, counts: torch.Tensor,
             experts: ExpertGroup
             ) -> Tuple[torch.Tensor, torch.Tensor, Dispatched]:
    """Send routed tokens to the ranks of their experts.

    Collective over ``experts.group``.

    Args:
        routed: ``(N, dim)`` token copies sorted by expert (all ``E``).
        counts: ``(E,)`` int tokens per expert, ``sum = N``.
        experts: the expert group.

    Returns:
        ``(tokens, local_counts, dispatched)``: the tokens this rank's
        experts compute, sorted by local expert (each expert's from every
        rank, in rank order), their count per local expert, and what
        :func:`combine` needs.
    """
    size = experts.size
    # recv[s, e]: tokens rank s sends to this rank's local expert e.
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=experts.group)
    send = counts.view(size, -1)
    recv = recv.view(size, -1)
    send_splits = send.sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    received = dist_fn.all_to_all_single(
        routed.new_empty((sum(recv_splits), routed.shape[1])), routed,
        recv_splits, send_splits, group=experts.group)
    # Received in (source rank, local expert) order; the experts need
    # (local expert, source rank).
    starts = (recv.flatten().cumsum(0) - recv.flatten()).view_as(recv)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + recv[s, e]),
                           device=routed.device)
              for e in range(recv.shape[1]) for s in range(size)]
    order = torch.cat(pieces) if pieces else \
        torch.zeros(0, dtype=torch.long, device=routed.device)
    return received[order], recv.sum(0), Dispatched(order, send_splits,
                                                    recv_splits)


def combine(computed: torch.Tensor, dispatched: Dispatched,
            experts: ExpertGroup) -> torch.Tensor:
    """Send computed tokens back to the ranks they came from, in the order
    they were sent (the inverse of :func:`dispatch`). Collective."""
    unsorted = torch.empty_like(computed).index_copy(0, dispatched.order,
                                                     computed)
    return dist_fn.all_to_all_single(
        computed.new_empty((sum(dispatched.send_splits),
                            computed.shape[1])), unsorted,
        dispatched.send_splits, dispatched.recv_splits, group=experts.group)


def run_local_experts(
        module: torch.nn.Module, routed: torch.Tensor, counts: torch.Tensor,
        compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``compute(routed, counts)`` on the experts this rank holds: the
    protocol's second form, for an experts module that sorts its tokens
    inside its forward (it declares ``expert_parallel_group``).

    Args:
        module: the experts module; under ep its ``expert_parallel_group``
            is the :class:`ExpertGroup` (set by mmpar), else None.
        routed: ``(N, dim)`` token copies sorted by expert (all ``E``).
        counts: ``(E,)`` rows of each expert.
        compute: the experts' computation; it gets the rows of the
            experts this rank holds and their counts, and returns one row
            per row.

    Returns:
        One output row per row of ``routed``, in its order. Under ep a
        collective over the group (:func:`dispatch`, :func:`combine`).
    """
    group = module.expert_parallel_group
    if group is None:
        return compute(routed, counts)
    tokens, local_counts, sent = dispatch(routed, counts, group)
    return combine(compute(tokens, local_counts), sent, group)


def local_experts(weight: torch.Tensor) -> torch.Tensor:
    """The experts of a stacked parameter this rank computes: under ep its
    DTensor's local ``E/ep`` (with autograd), else ``weight`` itself."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def protocol_params(name: str, module: torch.nn.Module) -> Sequence[str]:
    """``module``'s stacked expert parameters, checked against the
    protocol.

    Returns:
        The names it declares in ``expert_parallel_params``.

    Raises:
        ValueError: naming the module, what it breaks and what is
            allowed.
    """
    label = f'{name or "the model"} ({type(module).__name__})'
    names = module.expert_parallel_params
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f'{label}.expert_parallel_params={names!r} is not allowed; '
            'allowed: a tuple of the names of its stacked expert parameters')
    own = dict(module.named_parameters())
    lengths = set()
    for param in names:
        weight = own.get(param)
        if weight is None or weight.dim() < 1:
            raise ValueError(
                f'{label} declares expert_parallel_params {param!r}, which '
                'is not a parameter of it with the experts on dim 0; '
                f'allowed: its parameters {sorted(own)}')
        lengths.add(weight.shape[0])
    if len(lengths) > 1:
        raise ValueError(
            f'{label}: its expert_parallel_params {tuple(names)} stack '
            f'{sorted(lengths)} experts on dim 0; allowed: the same number '
            'of experts in each')
    others = sorted(set(own) - set(names))
    if others:
        raise ValueError(
            f'{label} has parameters {others} besides its experts '
            f'{tuple(names)}; allowed: only stacked expert parameters in an '
            'experts module (keep the router and shared layers outside it; '
            'docs/expert_parallel.md)')
    return tuple(names)


def expert_modules(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that meet the expert-parallel protocol
    (declare ``expert_parallel_params``), with their names."""
    return [(name, module) for name, module in model.named_modules()
            if getattr(module, 'expert_parallel_params', None)]


def no_experts_error(ep: int, model_type: Any) -> ValueError:
    """The refusal of ``parallel.ep=ep`` for a model with no experts."""
    return ValueError(
        f'parallel.ep={ep!r} is not allowed; model.type={model_type!r} has '
        'no mixture-of-experts layers (model.moe is not set), so there are '
        'no experts to split; allowed: parallel.ep=1, or model.moe=dict('
        'num_experts=..., ...) (docs/expert_parallel.md)')


def check_expert_model(model_cfg: Any, model_class: Callable[[], Any],
                       layout: Any) -> None:
    """At start-up: under ``parallel.ep > 1`` or ``parallel.pp > 1`` a
    model class that can tell from its config whether its experts can be
    split or staged says so (its classmethod ``check_expert_parallel(
    model_cfg, ep, pp)``, with ``ep=1`` when ep does not split: Llama,
    HFCausalLM); any other model is checked against the protocol when it
    is built.

    Args:
        model_cfg: the ``model`` section.
        model_class: returns the model's class (called under ep or pp only).
        layout: the ``ParallelDims``, or the ``ParallelConfig`` while the
            world size is unknown (its ``ep`` and ``pp``).

    Raises:
        ValueError: naming the key, the value and what is allowed.
    """
    ep, pp = layout.ep, layout.pp
    splits = ep is not None and ep > 1
    if not splits and (pp is None or pp <= 1):
        return
    if not isinstance(model_cfg, dict):
        if splits:
            raise no_experts_error(ep, model_cfg)
        return
    check = getattr(model_class(), 'check_expert_parallel', None)
    if callable(check):
        check(model_cfg, ep if splits else 1, pp)
