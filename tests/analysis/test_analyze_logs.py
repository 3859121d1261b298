"""tools/analyze_logs.py plot_curve on MMEngine-style scalar logs."""
import json

import pytest

from mmpar.analysis.curves import plot_curve, series
from tools.analyze_logs import main


def _write_log(path, offset=0.0):
    lines = [dict(loss=2.0 - 0.1 * i + offset, acc=0.1 * i, epoch=1,
                  iter=10 * i, step=10 * i) for i in range(1, 6)]
    lines += [{'accuracy/top1': 50.0 + i, 'step': i} for i in (1, 2)]
    path.write_text('\n'.join(json.dumps(line) for line in lines) + '\n')
    return path


def test_series_separates_train_and_val_axes(tmp_path):
    from mmpar.analysis.curves import load_scalars
    records = load_scalars(str(_write_log(tmp_path / 'scalars.json')))
    assert series(records, 'loss')['axis'] == 'iter'
    assert series(records, 'loss')['step'] == [10, 20, 30, 40, 50]
    val = series(records, 'accuracy/top1')
    assert (val['axis'], val['value']) == ('epoch', [51.0, 52.0])


def test_plot_two_runs_side_by_side(tmp_path, capsys):
    a = _write_log(tmp_path / 'a.json')
    b = _write_log(tmp_path / 'b.json', offset=0.3)
    out = tmp_path / 'curve.png'
    main(['plot_curve', str(a), str(b), '--keys', 'loss', 'accuracy/top1',
          '--out', str(out), '--legend', 'ddp', 'fsdp'])
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert 'wrote' in capsys.readouterr().out


def test_unknown_key_lists_logged_keys(tmp_path):
    log = _write_log(tmp_path / 'a.json')
    with pytest.raises(ValueError, match=r"\['lss'\].*logged keys: acc, "):
        plot_curve([str(log)], ['lss'], str(tmp_path / 'x.png'))
