"""Compare a layout's step records with the reference's and say where they
first part: the first step, and in it the first module in execution order
(forward outputs in the order modules finish, then the loss, then
parameter gradients in backward order, then the global grad norm) whose fingerprint
differs beyond ``atol + rtol x size``."""
import fnmatch
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from mmpar.verify.fingerprint import scales


@dataclass
class Verdict:
    """The outcome: ``agree``, the largest relative difference seen among
    the values that agreed, and the report's lines; ``failed``: this rank's
    layout run raised (its peers may still be inside a collective)."""
    agree: bool
    max_relative: float
    lines: List[str] = field(default_factory=list)
    failed: bool = False

    @property
    def text(self) -> str:
        return '\n'.join(self.lines)


def _difference(got: torch.Tensor, want: torch.Tensor, elements: int,
                rows: float, rtol: float, atol: float) -> Tuple[bool, float]:
    size = scales(want, elements, int(rows))
    diff = (got - want).abs()
    ok = bool((diff <= atol + rtol * size).all())
    # Entries within atol agree whatever their size (a gradient that is
    # zero in exact arithmetic is rounding noise at both layouts): they do
    # not count towards the relative difference.
    rel = diff / size.clamp_min(1e-300)
    return ok, float(rel.masked_fill(diff <= atol, 0).max())


def _scalar(got: Optional[float], want: Optional[float], rtol: float,
            atol: float) -> Tuple[bool, float]:
    if got is None or want is None:
        return True, 0.0
    diff = abs(got - want)
    rel = diff / max(abs(want), 1e-300) if diff > atol else 0.0
    return diff <= atol + rtol * abs(want), rel


def _checks(ref: dict, got: dict):
    """``(label, module, compare)`` in execution order; ``compare(rtol,
    atol)`` gives ``(ok, relative difference)``."""
    for name in ref['order']:
        mine = got['outputs'].get(name)
        if mine is None:
            continue
        for index, want in enumerate(ref['outputs'][name]):
            have = mine[index] if index < len(mine) else None
            if want is None or have is None:
                continue
            # Replication over the other axes divides out: each row of the
            # batch is held by (rows seen / reference rows) ranks.
            fp = have[0] * (want[1] / have[1])
            label = f'output {index}' if len(ref['outputs'][name]) > 1 \
                else 'output'
            yield (label, name, lambda r, a, fp=fp, want=want:
                   _difference(fp, want[0], want[2], want[1], r, a))
    yield ('loss', None, lambda r, a: _scalar(got['loss'], ref['loss'], r, a))
    position = {name: i for i, name in enumerate(ref['order'])}
    ready = {name: i for i, name in enumerate(ref.get('grad_order', ()))}

    def backward_order(param: str) -> tuple:
        # As the reference's gradients were ready; else the reverse of the
        # owner's forward.
        return (ready.get(param, len(ready)),
                -position.get(param.rpartition('.')[0], -1))

    for param in sorted(ref['grads'], key=backward_order):
        have = got['grads'].get(param)
        if have is None:
            continue
        want = ref['grads'][param]
        yield ('gradient of ' + param.rpartition('.')[2],
               param.rpartition('.')[0],
               lambda r, a, have=have, want=want:
               _difference(have[0], want[0], want[2], want[1], r, a))
    # Last: the norm is computed from the gradients above, which name a
    # module; it alone differs when only its reduction is wrong.
    yield ('global grad norm', None,
           lambda r, a: _scalar(got['grad_norm'], ref['grad_norm'], r, a))


def plan_entries(tp_plan, module: str) -> List[str]:
    """The entries of a ``parallel.tp_plan`` that reach ``module``."""
    if isinstance(tp_plan, str):
        return [f'tp: registered plan {tp_plan!r}']
    plan = (tp_plan or {}).get('plan') if isinstance(tp_plan, dict) else None
    return [f'tp: {style} plan on {pattern!r}'
            for pattern, style in (plan or {}).items()
            if fnmatch.fnmatchcase(module, pattern)]


def compare(reference: List[dict], layout: List[dict], *, rtol: float,
            atol: float, touches: Dict[str, List[str]], tp_plan=None,
            axes_line: str = '') -> Verdict:
    """Compare step by step; stop at the first difference.

    Args:
        reference: the reference run's steps (:class:`FingerprintHook`).
        layout: the layout's steps.
        rtol, atol: a value agrees when ``|got - want| <= atol + rtol x
            size`` (size: the value's own magnitude).
        touches: what the layout does to each module's parameters.
        tp_plan: the config's ``parallel.tp_plan`` (its entries are named).
        axes_line: the layout's sizes, for the report.
    """
    worst = 0.0
    lines = []
    for step, (ref, got) in enumerate(zip(reference, layout)):
        agreed: List[str] = []
        count = 0
        loss = ''
        for label, module, check in _checks(ref, got):
            ok, rel = check(rtol, atol)
            if ok:
                worst = max(worst, rel)
                count += 1
                if label == 'loss':
                    loss = f' (the loss within {rel:.3g})'
                if module is not None and label.startswith('output'):
                    agreed.append(module)
                continue
            where = f'module `{module or "(the model itself)"}` ({label})' \
                if module is not None else label
            lines.append(f'step {step} differs first at {where}: relative '
                         f'difference {rel:.3g} (rtol {rtol:g}, atol '
                         f'{atol:g})')
            shown = ', '.join(f'`{m}`' for m in agreed[-5:])
            more = f'{len(agreed) - 5} more, then ' if len(agreed) > 5 else ''
            lines.append(f'  agreed before it in step {step}: {count} values'
                         + loss + (f'; module outputs: {more}{shown}'
                            if agreed else ''))
            lines.append('  layout on it: ' + touching(module, touches,
                                                        tp_plan, axes_line))
            return Verdict(False, worst, lines)
        lines.append(f'step {step}: {count} values agree')
    steps = min(len(reference), len(layout))
    lines.append(f'all {steps} steps agree (max relative difference '
                 f'{worst:.3g}; rtol {rtol:g}, atol {atol:g})')
    return Verdict(True, worst, lines)


def touching(module: Optional[str], touches: Dict[str, List[str]],
             tp_plan, axes_line: str) -> str:
    """What the layout does to ``module``: the tp plan's entries that
    reach it, its parameters' placements, and the layout's sizes."""
    found = []
    if module is not None:
        placed = touches.get(module, [])
        if not isinstance(tp_plan, str) or any(
                p.startswith('tp:') for p in placed):
            found += plan_entries(tp_plan, module)
        found += placed
    found.append(axes_line or 'no parallel axis')
    return '; '.join(found)
