"""Training curves from MMEngine's ``vis_data/scalars.json`` logs."""
import json
import os.path as osp
from typing import Dict, List, Optional, Sequence


def load_scalars(path: str) -> List[dict]:
    """The JSON lines of one ``scalars.json``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not JSON (names the file and line number).
    """
    if not osp.isfile(path):
        raise FileNotFoundError(f'log file {path!r} does not exist')
    records = []
    with open(path) as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f'{path}:{number} is not JSON: {err}') from None
    return records


def series(records: Sequence[dict], key: str) -> Dict[str, list]:
    """``dict(step=[...], value=[...])`` for every record holding ``key``.

    Training records are stepped by iteration; validation records (which have
    no ``iter``) by epoch, so they go into a separate ``epoch`` axis.
    """
    rows = [r for r in records if key in r]
    axis = 'iter' if rows and 'iter' in rows[0] else 'epoch'
    return dict(
        axis=axis,
        step=[r.get('step') for r in rows],
        value=[r[key] for r in rows])


def plot_curve(log_files: Sequence[str],
               keys: Sequence[str],
               out: str,
               legend: Optional[Sequence[str]] = None,
               title: Optional[str] = None) -> str:
    """Plot ``keys`` of one or several runs, one panel per key, into ``out``.

    Args:
        log_files: ``scalars.json`` files; several runs are drawn side by side
            in each panel.
        keys: logged names, e.g. ``loss``, ``acc``, ``accuracy/top1``.
        out: the image to write (PNG, SVG, PDF by extension).
        legend: a label per run (default: the run's folder names).
        title: figure title.

    Raises:
        ValueError: a key that no run logged (the message lists those that
            were logged).
    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    runs = [load_scalars(path) for path in log_files]
    if legend is None:
        legend = [_run_name(path) for path in log_files]
    if len(legend) != len(runs):
        raise ValueError(f'--legend has {len(legend)} labels for '
                         f'{len(runs)} log files')
    logged = sorted({k for run in runs for r in run for k in r})
    missing = [k for k in keys if k not in logged]
    if missing:
        raise ValueError(f'--keys {missing} not found in the logs; logged '
                         f'keys: {", ".join(logged)}')
    fig, axes = plt.subplots(
        1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for axis, key in zip(axes[0], keys):
        for run, label in zip(runs, legend):
            data = series(run, key)
            if data['step']:
                axis.plot(data['step'], data['value'], label=label,
                          marker='o' if data['axis'] == 'epoch' else None,
                          markersize=3)
                axis.set_xlabel(data['axis'])
        axis.set_title(key)
        axis.grid(alpha=0.3)
        axis.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _run_name(path: str) -> str:
    # work_dirs/NAME/TIMESTAMP/vis_data/scalars.json -> NAME
    parts = osp.normpath(osp.abspath(path)).split(osp.sep)
    return parts[-4] if len(parts) >= 4 else path
