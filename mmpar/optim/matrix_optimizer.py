"""One optimizer for a whole-matrix rule (Muon...) and AdamW for the rest.

A whole-matrix optimizer transforms each 2-D parameter's update as a whole
matrix; embeddings, the output head, norms and biases are left to AdamW
(the parameters :mod:`mmpar.optim.matrix_constructor` routes). Both live in
one ``torch.optim.Optimizer`` so that everything MMEngine and torch do with
an optimizer sees both: ``param_groups`` (LR schedulers scale each group from
its own initial lr), ``zero_grad``, ``state_dict`` / ``load_state_dict``
(one state, indexed over every group, as DCP and full checkpoints save it).

Each group says which rule it follows: ``matrix=True`` for the whole-matrix
rule, ``matrix=False`` for AdamW, whose settings (``lr``, ``betas``,
``eps``, ``weight_decay``, ...) the group takes from the ``adamw`` argument
where it does not name its own. A group without ``matrix`` is split: its
2-D parameters to the rule, the others to AdamW.

A subclass gives the rule in three parts (:class:`mmpar.optim.muon.Muon`):
``prepare`` (elementwise, on this rank's shard: momentum and the like),
``transform`` (a function of the whole matrix, which
:func:`mmpar.optim.whole_matrix.apply_to_whole` runs on the gathered matrix
under any layout) and ``apply`` (elementwise: the parameter update).
"""
import inspect
from typing import Iterable, Optional

import torch
from torch.optim import AdamW, Optimizer

from mmpar.optim.whole_matrix import apply_to_whole
from mmpar.parallel.dtensor import local_grad, local_tensor

MATRIX = 'matrix'
# torch.optim.AdamW's keyword arguments and defaults: what ``adamw`` may set.
ADAMW_DEFAULTS = {
    name: arg.default
    for name, arg in inspect.signature(AdamW).parameters.items()
    if name != 'params'
}


class WholeMatrixOptimizer(Optimizer):
    """Base class: a whole-matrix rule for ``matrix`` groups, torch's
    AdamW for the others (one state, one ``param_groups``).

    Args:
        params: parameters or groups (see the module docstring).
        defaults: the rule's hyperparameters.
        adamw: settings of the AdamW groups (``torch.optim.AdamW``'s
            keyword arguments); torch's defaults for the rest.

    Raises:
        ValueError: an ``adamw`` key AdamW does not take or a value it
            refuses, or a ``matrix`` group with a parameter that is not
            2-D.
    """

    def __init__(self, params: Iterable, defaults: dict,
                 adamw: Optional[dict] = None):
        unknown = sorted(set(adamw or {}) - set(ADAMW_DEFAULTS))
        if unknown:
            raise ValueError(
                f'adamw: {unknown} are not arguments of torch.optim.AdamW; '
                f'allowed: {sorted(ADAMW_DEFAULTS)}')
        self.adamw_defaults = dict(ADAMW_DEFAULTS, **(adamw or {}))
        try:
            # torch's AdamW checks its arguments' values (lr, betas, eps,
            # weight_decay...), not its groups': checked here, not found
            # wrong in the first step, or never (a negative lr).
            AdamW([torch.empty(0)], **self.adamw_defaults)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f'adamw={adamw!r}: torch.optim.AdamW refuses '
                             f'it: {err}') from err
        self._adamw: Optional[AdamW] = None
        self._built = False
        super().__init__(params, defaults)
        self._built = True
        self._link_adamw()

    # ------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        params = param_group['params']
        # A list once: a generator (``module.parameters()``) is read here.
        params = param_group['params'] = [params] if isinstance(
            params, torch.Tensor) else list(params)
        if MATRIX not in param_group:
            for matrix in (True, False):
                mine = [p for p in params if (p.ndim == 2) == matrix]
                if mine:
                    self.add_param_group(
                        dict(param_group, params=mine, matrix=matrix))
            return
        if param_group[MATRIX]:
            for param in params:
                if param.ndim != 2:
                    raise ValueError(
                        f'{type(self).__name__} transforms 2-D parameters '
                        f'only; a matrix group holds one of size '
                        f'{tuple(param.shape)}')
        else:
            for key, value in self.adamw_defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        if self._built and not param_group[MATRIX]:
            self._link_adamw()

    def _link_adamw(self) -> None:
        """torch's AdamW over this optimizer's AdamW groups (the same group
        dicts) and this optimizer's state: what a scheduler or a load sets
        here, it sees."""
        groups = [g for g in self.param_groups if not g[MATRIX]]
        self._adamw = AdamW(groups) if groups else None
        if self._adamw is not None:
            self._adamw.state = self.state

    def __getstate__(self) -> dict:
        return dict(super().__getstate__(), adamw_defaults=self.adamw_defaults)

    def __setstate__(self, state: dict) -> None:
        # Also what load_state_dict ends with: new group dicts, new state.
        super().__setstate__(state)
        self._built = True
        self._link_adamw()

    # ------------------------------------------------------------- step

    def prepare(self, param: torch.Tensor, grad: torch.Tensor, state: dict,
                group: dict) -> torch.Tensor:
        """This rank's part of the matrix to transform (elementwise work on
        the local shard ``grad``); ``state`` is the parameter's."""
        raise NotImplementedError

    def transform(self, matrix: torch.Tensor, group: dict) -> torch.Tensor:
        """The whole-matrix function (runs on the whole, gathered matrix)."""
        raise NotImplementedError

    def apply(self, param: torch.Tensor, local: torch.Tensor,
              update: torch.Tensor, state: dict, group: dict) -> None:
        """Update this rank's part ``local`` of ``param`` in place from its
        part ``update`` of the transformed matrix."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        """One step: the whole-matrix rule, then AdamW."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, groups, parts = [], [], []
        for group in self.param_groups:
            if not group[MATRIX]:
                continue
            for param in group['params']:
                if param.grad is None:
                    continue
                params.append(param)
                groups.append(group)
                parts.append(self.prepare(param, local_grad(param),
                                          self.state[param], group))
        if params:
            updates = apply_to_whole(
                params, parts, lambda i, whole: self.transform(
                    whole, groups[i]))
            for param, group, update in zip(params, groups, updates):
                self.apply(param, local_tensor(param), update,
                           self.state[param], group)
        if self._adamw is not None:
            self._adamw.step()
        return loss
