"""A loss over the counted tokens of a whole optimizer step, on every layout.

A language model's loss is a mean over *counted* tokens (padding and masked
prompt tokens are not counted). Averaging per-rank, per-micro-batch means is
the one-process mean only while every rank and micro-batch counts as many
tokens; context parallelism (a rank holds chunks of a sequence), padding and
masks break that. So a model that returns its count next to its loss
(``dict(loss=mean over counted tokens, num_tokens=count)``, as
:func:`mmpar.models.lm_loss.lm_outputs` does) is trained on

    loss = (sum of the token losses of the window) / (tokens counted in it)

where the window is every micro-batch of one optimizer step on every rank
that reads different tokens (the gradient axis, ``dp x cp``). MMEngine's
loop hands the step one micro-batch at a time, so the count of the window is
known only at its end; gradients are linear in the loss, so each micro-batch
backpropagates its token *sum* (:func:`token_sum`), the data-parallel
wrapper averages over its ``G`` ranks as usual, and before the optimizer
step (and before the clip, which must see the final gradients) every
gradient is multiplied by ``G / N`` (:func:`scale_grads`), ``N`` the tokens
the window counted, summed over the ranks by :func:`reduce_token_log_vars`
once per micro-batch (one all-reduce of a few numbers, which also makes the
logged loss the one-process value of the micro-batch).

:class:`mmpar.optim.optim_wrapper.ParallelOptimMixin` drives it
(``loss_to_backward``, ``count_tokens``, the scaling in ``step``).
"""
import math
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from mmpar.parallel.dtensor import local_tensor

# The key of the count next to the loss terms (MMEngine logs it as well).
TOKENS_KEY = 'num_tokens'


def is_token_counted(log_vars: Dict[str, torch.Tensor]) -> bool:
    """Whether a micro-batch's parsed losses carry their token count."""
    return TOKENS_KEY in log_vars


def token_sum(loss: torch.Tensor,
              log_vars: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss a micro-batch backpropagates: its mean times its count (the
    sum over its counted tokens; no gradient flows through the count)."""
    return loss * log_vars[TOKENS_KEY].detach().to(loss.dtype)


def group_size(groups: Iterable[Optional[dist.ProcessGroup]]) -> int:
    """Ranks over which the groups together average (``None``: the
    world)."""
    return math.prod(dist.get_world_size(group) for group in groups)


def reduce_token_log_vars(log_vars: Dict[str, torch.Tensor],
                          groups: Iterable[Optional[dist.ProcessGroup]]
                          ) -> Tuple[Dict[str, torch.Tensor], float]:
    """A micro-batch's log variables over every rank of ``groups``.

    Collective: every rank of the groups calls it, one group after the
    other. Each term (a mean over this rank's counted tokens) becomes the
    token-weighted mean over the ranks; the count becomes their sum.

    Returns:
        ``(log_vars, count)``: new detached tensors, and the summed count.
    """
    count = log_vars[TOKENS_KEY].detach()
    names = [k for k in log_vars if k != TOKENS_KEY]
    # float64: sums of many token losses stay exact enough to log, and the
    # count exact.
    sums = torch.stack([log_vars[k].detach().double() * count.double()
                        for k in names] + [count.double()])
    for group in groups:
        dist.all_reduce(sums, group=group)
    total = float(sums[-1])
    means = sums[:-1] / max(total, 1.0)
    reduced = {k: means[i].to(log_vars[k].dtype) for i, k in enumerate(names)}
    reduced[TOKENS_KEY] = sums[-1].to(count.dtype)
    return reduced, total


@torch.no_grad()
def scale_grads(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every ``.grad`` by ``factor`` (a DTensor's local shard: each
    rank scales its part)."""
    for param in params:
        if param.grad is not None:
            local_tensor(param.grad).mul_(factor)
