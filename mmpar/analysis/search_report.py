"""The layout search as text and as a config: the ranked table, the message
when nothing fits the budget, and the winning layout written as a config
that inherits the user's (``tools/plan.py CONFIG --search``)."""
import json
import os
import os.path as osp
from collections import defaultdict
from typing import List, Optional

from mmpar.analysis.search_table import (FAILED, MEASURED, OVER_BUDGET,
                                         REFUSED, SKIPPED, STOPPED, Row,
                                         SearchResult, mib)

def _times(value: Optional[float]) -> str:
    return '-' if value is None else f'{value:.2f}x'


def format_search(result: SearchResult) -> str:
    """The ranked table, then what was not run and why."""
    table = [('layout', 'predicted peak/rank', 'measured peak/rank',
              's/step', 'trials', result.unit, 'vs best', 'vs as written')]
    for row in result.rows:
        if row.status not in (MEASURED, STOPPED):
            continue
        label = row.candidate.label + (' (as written)' if row.as_written
                                       else '')
        if row.status == STOPPED:
            label += ' (stopped early)'
        table.append((label, mib(row.predicted_peak),
                      mib(row.measured_peak), f'{row.step_time:.3f}',
                      str(len(row.passes) or 1),
                      f'{result.throughput(row):,.0f}',
                      *map(_times, result.versus(row))))
    lines = []
    if len(table) > 1:
        widths = [max(map(len, column)) for column in zip(*table)]
        lines = ['  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(cells, widths)))
                 for cells in table]
        lines.append('s/step: the median step of the candidate\'s least '
                     'disturbed trial (load only slows a trial down)')
    return '\n'.join(lines + _not_run_lines(result))


def _not_run_lines(result: SearchResult) -> List[str]:
    lines = []
    for status, title in ((FAILED, 'failed'), (SKIPPED, 'skipped'),
                          (OVER_BUDGET, 'over the memory budget')):
        rows = [r for r in result.rows if r.status == status]
        if rows:
            lines += ['', f'{title} ({len(rows)}):']
            lines += [f'  {r.candidate.label}: {r.message}' for r in rows]
    by_message = defaultdict(list)
    for row in result.rows:
        if row.status == REFUSED:
            by_message[row.message].append(row.candidate.label)
    if by_message:
        total = sum(len(v) for v in by_message.values())
        lines += ['', f'refused by the validator ({total}):']
        for message, labels in by_message.items():
            shown = ', '.join(labels[:3]) + (
                f' and {len(labels) - 3} more' if len(labels) > 3 else '')
            lines.append(f'  {shown}: {message}')
    return lines


def nothing_fits(result: SearchResult) -> Optional[str]:
    """Why no candidate could run (None when some did): the smallest
    predicted peak, what it is made of and which axis would lower it."""
    if any(r.status in (MEASURED, STOPPED, FAILED) for r in result.rows):
        return None
    fitting = [r for r in result.rows if r.status == OVER_BUDGET]
    if not fitting:
        return (f'no layout of {result.world_size} ranks is legal for this '
                'config (the validator refused every candidate; see above)')
    smallest = min(fitting, key=lambda r: r.predicted_peak)
    est = smallest.estimate
    budget = result.memory_budget * 2**30
    text = (f'no layout of {result.world_size} ranks fits --memory-budget '
            f'{result.memory_budget:g} GiB per rank: the smallest predicted '
            f'peak is {mib(smallest.predicted_peak)} '
            f'({smallest.candidate.label}: a rank besides its model '
            f'{mib(est.baseline)}, parameters + gradients + optimizer state '
            f'{mib(est.steady)}, FSDP gathered unit '
            f'{mib(est.gathered_unit)}, activations '
            f'{mib(est.activations)}; build {mib(est.build)}). ')
    return text + _what_would_help(result, smallest, budget)


def _what_would_help(result: SearchResult, row: Row, budget: float) -> str:
    est = row.estimate
    axes = row.candidate.axes
    tp_refused = any(r.status == REFUSED and r.candidate.axes['tp'] > 1
                     for r in result.rows)
    if est.baseline >= budget:
        return ('No layout can help: a rank holds that much before its '
                'model (imports, process group, data set, logging); the '
                f'budget must exceed {mib(est.baseline)}.')
    terms = dict(activations=est.activations or 0, steady=est.steady,
                 gathered=est.gathered_unit)
    largest = max(terms, key=terms.get)
    if largest == 'activations':
        hints = [f'more pipeline micro-batches (pp={axes["pp"]}; '
                 '--microbatches)' if axes['pp'] > 1 else
                 'pipeline parallelism (pp) with more micro-batches']
        if row.candidate.checkpointing != 'full':
            hints.append("activation checkpointing mode 'full'")
        hints.append('a larger tp' + (' (refused here: see why above)'
                                      if tp_refused else ''))
        hints += ['context parallelism (cp)',
                  'a smaller global batch (train_dataloader.batch_size)']
        return ('Of what a layout changes, activations are the largest '
                'part; what lowers them: ' +
                ', '.join(hints) + '.')
    if largest == 'steady' and not row.estimate.gathered_unit:
        return ('Of what a layout changes, parameters, gradients and '
                'optimizer state are the largest part and the wrapper '
                'replicates them on every data rank: a sharding wrapper '
                "(model_wrapper_cfg=dict(type='MMFullyShard')) divides them "
                'over dp_shard; tp and pp split them too, as do more ranks.')
    return ('Of what a layout changes, parameters, gradients, optimizer '
            'state and the gathered FSDP unit are the largest part: more '
            'ranks on dp_shard, tp or pp divide them (a finer wrap policy '
            'shrinks the gathered unit).')


def _py(value) -> str:
    """``value`` as config source: dicts as ``dict(...)``."""
    if isinstance(value, dict) and all(
            isinstance(k, str) and k.isidentifier() for k in value):
        return 'dict(' + ', '.join(f'{k}={_py(v)}'
                                   for k, v in value.items()) + ')'
    if isinstance(value, list):
        return '[' + ', '.join(_py(v) for v in value) + ']'
    if isinstance(value, tuple):
        return '(' + ', '.join(_py(v) for v in value) + \
            (',)' if len(value) == 1 else ')')
    return repr(value)


def _nested(options: Optional[dict]) -> dict:
    """``--cfg-options`` (``{'a.b': 1}``) as the dicts a config file writes
    (``a = dict(b=1)``, merged into the base like the option was)."""
    nested = {}
    for dotted, value in (options or {}).items():
        *parents, leaf = dotted.split('.')
        node = nested
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return nested


def best_config_text(result: SearchResult, config_path: str,
                     out_path: str, cfg_options: Optional[dict] = None
                     ) -> str:
    """The fastest layout as a config inheriting ``config_path``: only the
    keys it changes (a dict replacing a dict says ``_delete_=True``; the
    per-rank batch merges into the user's loader), after the
    ``cfg_options`` the search was run with (so that it trains what was
    measured)."""
    from mmengine.config import Config
    best = result.best
    base = Config.fromfile(config_path)
    options = _nested(cfg_options)
    relative = osp.relpath(osp.abspath(config_path),
                           osp.dirname(osp.abspath(out_path)))
    speed = result.throughput(best)
    vs_written = result.versus(best)[1]
    versus = '' if vs_written is None else \
        f'; {vs_written:.2f}x the config as written'
    lines = [
        f'# The fastest layout of {result.world_size} ranks that the '
        'layout search (--search) measured',
        f'# for {osp.basename(config_path)} in the job it ran in '
        f'({result.warmup_steps} + {result.trial_steps} steps each, '
        f'global batch {result.global_batch}):',
        f'#   {best.candidate.label}: {speed:,.0f} {result.unit}, peak '
        f'{mib(best.measured_peak)} per rank{versus}.',
        f'#   bash tools/dist_train.sh {out_path} {result.world_size}',
        f'_base_ = [{relative!r}]']
    if options:
        lines.append('# --cfg-options of the search: '
                     + ' '.join(f'{k}={v!r}' for k, v in cfg_options.items()))
    keys = dict.fromkeys(list(options) + list(best.changes))
    for key in keys:
        if key not in best.changes:
            lines.append(f'{key} = {_py(options[key])}')
            continue
        value = best.changes[key]
        if key == 'train_dataloader':
            lines.append('# The global batch stays '
                         f'{result.global_batch} samples per step.')
            value = dict(options.get(key, {}), **value)  # batch_size
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            value = dict(_delete_=True, **value)
        lines.append(f'{key} = {_py(value)}')
    return '\n'.join(lines) + '\n'


def write_search(result: SearchResult, config_path: str,
                 out_dir: str, cfg_options: Optional[dict] = None,
                 exit_status: int = 0) -> Optional[str]:
    """Write ``search.json`` (the table, and the ``exit_status`` the
    search ends with) and, when a layout was measured, the best layout's
    config into ``out_dir``; return the config's path."""
    os.makedirs(out_dir, exist_ok=True)
    with open(osp.join(out_dir, 'search.json'), 'w') as f:
        json.dump(dict(world_size=result.world_size,
                       global_batch=result.global_batch,
                       memory_budget=result.memory_budget,
                       elapsed_s=result.elapsed_s,
                       exit_status=exit_status, rows=result.table()),
                  f, indent=1, default=str)
    if result.best is None:
        return None
    stem = osp.splitext(osp.basename(config_path))[0]
    path = osp.join(out_dir, f'{stem}_best_{result.world_size}ranks.py')
    with open(path, 'w') as f:
        f.write(best_config_text(result, config_path, path, cfg_options))
    return path


def search_main(args, cfg) -> int:
    """``tools/plan.py CONFIG --world-size N --search``: a front that runs
    the search where it lives, in a launched job (``bash
    tools/dist_train.sh CONFIG N --search --search-only``, on this node);
    the job prints progress on stderr and the table on stdout. Exit 0 with
    a config written, 3 when nothing fits the budget, 2 when nothing is
    legal or every trial failed."""
    import subprocess
    import sys

    from mmpar.analysis.search_args import (default_out,
                                            search_argument_error,
                                            search_flags)
    error = search_argument_error(args)
    if error is not None:
        print(f'error: {error}', file=sys.stderr)
        return 2
    args.out = args.out or default_out(args.config)
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    command = ['bash', osp.join(root, 'tools', 'dist_train.sh'), args.config,
               str(args.world_size), '--search', '--search-only',
               *search_flags(args)]
    if args.cfg_options:
        command += ['--cfg-options'] + [f'{key}={_option(value)}' for
                                        key, value in args.cfg_options.items()]
    # One node, no PORT: dist_train.sh lets torchrun bind a free port.
    job = subprocess.run(command)
    try:
        with open(osp.join(args.out, 'search.json')) as f:
            return json.load(f)['exit_status']
    except (OSError, ValueError, KeyError):
        return job.returncode or 2


def _option(value) -> str:
    """A parsed ``--cfg-options`` value as the command line wrote it."""
    if isinstance(value, (list, tuple)):
        inner = ','.join(_option(v) for v in value)
        return f'[{inner}]' if isinstance(value, list) else f'({inner})'
    return str(value)
