"""The layout search (issue 24), a phase of the launched job (issue 34).

Fast: the candidates of a config (illegal ones refused with the
validator's own message, the memory budget's filter), the config written
for the winner (inherits the input, sets only what changes). Through the
user's entry points: one real search at 2 ranks in the job of
``tools/dist_train.sh --search --search-only`` whose written config then
trains through ``tools/dist_train.sh``; one without ``--search-only`` that
goes on training the winner; and, through the local front ``tools/plan.py
--search``, the message and exit status when nothing fits the budget.
"""
import json
import re

import pytest
from mmengine.config import Config

from mmpar.analysis.layouts import Candidate, candidate_config
from mmpar.analysis.plan import PlanError, make_plan
from mmpar.analysis.search import (OVER_BUDGET, REFUSED, SKIPPED, Row,
                                   SearchResult, add_baseline, apply_budget,
                                   plan_candidates)
from mmpar.analysis.search_report import best_config_text, nothing_fits
from mmpar.config_check import check_config
from mmpar.parallel.dims import AXES
from tests.e2e import ROOT, run_nodes, run_tool

TINY = 'tests/data/search_llama.py'
VIT = 'configs/vit_digits/vit_digits.py'
GiB = 2**30
# A fixed baseline: the candidates' predictions without a measuring process.
BASELINE = 300 * 2**20


def _sizes(**axes):
    return tuple((axis, axes.get(axis, 1)) for axis in AXES)


def planned(cfg, world_size, budget=None, **choices):
    """The candidates as the job has them before its trials: planned,
    the (here fixed) baseline added, the budget applied."""
    rows, batch = plan_candidates(cfg, world_size, **choices)
    add_baseline(rows, BASELINE)
    apply_budget(rows, budget)
    return rows, batch


@pytest.fixture(scope='module')
def tiny_rows():
    cfg = Config.fromfile(str(ROOT / TINY))
    rows, batch = planned(
        cfg, 2, schedules=['1F1B', 'Interleaved1F1B'], microbatches=[2],
        checkpointing=[None, 'full'])
    return cfg, rows, batch


def test_candidates_cover_every_axis_and_keep_the_global_batch(tiny_rows):
    cfg, rows, batch = tiny_rows
    labels = {r.candidate.label for r in rows}
    # DDP replicates: dp_replicate is not a separate choice.
    assert {'dp_shard=2', 'tp=2', 'cp=2', 'pp=2 (1F1B, 2 mb)',
            'dp_shard=2 ckpt=full'} <= labels
    assert not any('dp_replicate' in label for label in labels)
    assert rows[0].as_written and rows[0].candidate.label == 'dp_shard=2'
    assert batch == 8  # 4 per rank x 2 data ranks, for every candidate
    for row in rows:
        if row.config is not None:
            data = row.candidate.data_ranks
            assert row.config.train_dataloader.batch_size * data == batch


def test_illegal_layouts_carry_the_validators_own_message(tiny_rows):
    _, rows, _ = tiny_rows
    refused = [r for r in rows if r.status == REFUSED]
    # 2 layers cannot make pp=2 x 2 stages per rank.
    assert refused and all('Interleaved1F1B' in r.candidate.label
                           for r in refused)
    for row in refused:
        check_config(row.config, 2)  # the start-up check lets it through,
        with pytest.raises((PlanError, ValueError)) as err:
            make_plan(row.config, 2)  # splitting the model refuses it
        assert row.message == str(err.value)
        assert 'parallel.pipeline asks for 4 stages' in row.message


def test_a_model_without_the_cp_protocol_has_cp_refused():
    cfg = Config.fromfile(str(ROOT / VIT))
    rows, _ = planned(cfg, 2, checkpointing=[None], schedules=['1F1B'],
                      microbatches=[2])
    cp = next(r for r in rows if r.candidate.axes['cp'] == 2)
    assert cp.status == REFUSED
    assert cp.message.startswith('parallel.cp=2 is not allowed')


def test_budget_filter_and_lightest_checkpointing(tiny_rows):
    cfg, rows, _ = tiny_rows
    legal = [r for r in rows if r.status != REFUSED]
    peaks = sorted({r.predicted_peak for r in legal})
    assert len(peaks) > 2 and peaks[0] > BASELINE
    budget = (peaks[0] + peaks[-1]) / 2 / GiB
    filtered, _ = planned(
        cfg, 2, budget, schedules=['1F1B', 'Interleaved1F1B'],
        microbatches=[2], checkpointing=[None, 'full'])
    over = [r for r in filtered if r.status == OVER_BUDGET]
    kept = [r for r in filtered if r.status not in (OVER_BUDGET, REFUSED)]
    assert over and kept
    assert all(r.predicted_peak > budget * GiB for r in over)
    assert all(r.predicted_peak <= budget * GiB for r in kept)
    assert 'GiB > --memory-budget' in over[0].message
    # Without a budget every layout fits unchekpointed: full is skipped.
    skipped = [r for r in rows if r.status == SKIPPED]
    assert skipped and all(r.candidate.checkpointing == 'full'
                           for r in skipped)


def test_written_config_inherits_and_sets_only_changed_keys(tmp_path):
    cfg = Config.fromfile(str(ROOT / TINY))
    candidate = Candidate(_sizes(pp=2), '1F1B', 2, 1, 'full')
    full, changes = candidate_config(cfg, candidate, 8,
                                     block_names=['LlamaBlock'])
    assert set(changes) == {'parallel', 'activation_checkpointing',
                            'train_dataloader'}
    row = Row(candidate, status='measured', changes=changes)
    result = SearchResult(2, 8, [row], None, 1, 1)
    row.trial = _trial([0.1], [400 * 2**20] * 2)
    out = tmp_path / 'best.py'
    out.write_text(best_config_text(result, str(ROOT / TINY), str(out)))
    text = out.read_text()
    assigned = re.findall(r'^(\w+) = ', text, re.M)
    assert assigned == ['_base_', 'parallel', 'activation_checkpointing',
                        'train_dataloader']
    written = Config.fromfile(str(out))
    assert written.parallel == full.parallel
    assert written.parallel.pipeline == dict(schedule='1F1B',
                                             num_microbatches=2)
    assert written.activation_checkpointing == dict(
        module_classes=['LlamaBlock'], mode='full')
    assert written.train_dataloader == full.train_dataloader
    assert written.train_dataloader.batch_size == 8  # one data rank
    assert written.model == cfg.model and written.optim_wrapper == \
        cfg.optim_wrapper
    # The config's own layout changes nothing.
    own = Candidate(_sizes(dp_shard=2))
    assert candidate_config(cfg, own, 8)[1] == {}


def _trial(times, peaks):
    from mmpar.analysis.search_table import TrialResult
    return TrialResult(step_times=times, tokens_per_step=256,
                       peak_rss=peaks)


def test_nothing_fits_names_the_smallest_peak_and_an_axis():
    cfg = Config.fromfile(str(ROOT / TINY))
    cfg.merge_from_dict({'train_dataloader.batch_size': 64,
                         'train_dataloader.dataset.context_length': 128,
                         'model.max_seq_len': 128})
    rows, batch = planned(cfg, 2, schedules=['1F1B'], microbatches=[2],
                          checkpointing=[None])
    smallest = min(r.predicted_peak for r in rows if r.status != REFUSED)
    budget = (smallest - 2**20) / GiB
    for row in rows:
        if row.status != REFUSED:
            row.status = OVER_BUDGET
    message = nothing_fits(SearchResult(2, batch, rows, budget, 1, 1))
    assert f'the smallest predicted peak is {smallest / 2**20:,.0f} MiB' \
        in message
    assert 'Of what a layout changes, activations are the largest part' \
        in message
    assert "activation checkpointing mode 'full'" in message


# Four candidates (dp_shard=2 as written, tp=2, cp=2, pp=2), one timed step
# each, no confirm rounds: the cheapest search that still ranks a table.
SMALL_SEARCH = ['--trial-steps', 1, '--warmup-steps', 1, '--confirm', 0,
                '--checkpointing', 'none', '--schedules', '1F1B',
                '--microbatches', 2]
FOUR = {'dp_shard=2', 'tp=2', 'cp=2', 'pp=2 (1F1B, 2 mb)'}


def _checkpoint_of(work_dir):
    return (work_dir / 'iter_2.pth').exists() or \
        (work_dir / 'iter_2').exists()


def test_search_only_in_the_launched_job_then_dist_train(tmp_path):
    out = tmp_path / 'search'
    proc = run_tool(['bash', 'tools/dist_train.sh', TINY, 2, '--search',
                     '--search-only', *SMALL_SEARCH, '--out', out,
                     '--work-dir', tmp_path / 'job'])
    # Progress on stderr (rank 0): candidate i of n with the time so far;
    # the baseline measured in the job, on its backend.
    assert re.search(r'\[1/4 \d+m\d\ds\] dp_shard=2 \.\.\.', proc.stderr)
    assert re.search(r'\[4/4 \d+m\d\ds\] ', proc.stderr)
    assert 'measured in this job, cpu, backend gloo, 2 ranks' in proc.stderr
    table = proc.stdout
    assert 'predicted peak/rank' in table and 'vs as written' in table
    assert '(as written)' in table and 'in the launched job' in table
    result = json.loads((out / 'search.json').read_text())
    assert result['exit_status'] == 0
    measured = [r for r in result['rows']
                if r['status'] in ('measured', 'stopped early')]
    assert {r['layout'] for r in measured} == FOUR
    for row in measured:
        assert row['throughput'] > 0 and row['measured_peak'] > 2**20
        assert row['predicted_peak'] > 2**20
    best = result['rows'][0]
    assert best['vs_best'] == 1.0
    written = out / 'search_llama_best_2ranks.py'
    assert f'wrote {written}' in table
    # Every trial ran in the job's 2 ranks, logged under --out.
    assert len(list((out / 'trials').glob('trial*'))) == 4
    assert not _checkpoint_of(tmp_path / 'job')  # --search-only: no training
    text = written.read_text()
    assert re.search(r"^_base_ = \['.*tests/data/search_llama.py'\]", text,
                     re.M)
    assert set(re.findall(r'^(\w+) = ', text, re.M)) - {'_base_'} == \
        set(best['changes'])
    trained = run_tool(['bash', 'tools/dist_train.sh', written, 2,
                        '--work-dir', tmp_path / 'train'])
    assert re.search(r'Iter\(train\) \[2/2\]',
                     trained.stdout + trained.stderr)
    assert _checkpoint_of(tmp_path / 'train')


def test_search_then_the_same_job_trains_the_winner(tmp_path):
    # Two "nodes" of one rank each on the loopback (NNODES=2, one
    # dist_train.sh per node, each with its own --out and work dir, as on
    # separate machines): every trial runs on the ranks of both nodes. And
    # through the sweep (--sweep 1: the same 4 candidates, no early stop):
    # the mode the benchmark compares the search with runs in the job too.
    def node(rank):
        return ['bash', 'tools/dist_train.sh', TINY, 1, '--search',
                *SMALL_SEARCH, '--sweep', 1, '--out', tmp_path / f'out{rank}',
                '--work-dir', tmp_path / f'job{rank}']
    log = run_nodes(node)[0]
    out, job = tmp_path / 'out0', tmp_path / 'job0'
    assert '4 to run x 1 (sweep)' in log
    assert 'measured in this job, cpu, backend gloo, 2 ranks' in log
    assert len(re.findall(r'\[sweep 1\.\d \d+m\d\ds\] \S.*: [\d.]+ s/step',
                          log)) == 4
    result = json.loads((out / 'search.json').read_text())
    assert result['world_size'] == 2
    measured = [r for r in result['rows'] if r['status'] == 'measured']
    assert {r['layout'] for r in measured} == FOUR
    for row in measured:  # one peak from each node's rank
        assert len(row['measured_peaks']) == 2
        assert min(row['measured_peaks']) > 2**20
    best = result['rows'][0]
    assert f'training with the searched layout {best["layout"]}' in log
    assert re.search(r'Iter\(train\) \[2/2\]', log)
    assert _checkpoint_of(job)
    # It trained the written winner (MMEngine dumps the config it ran).
    ran = Config.fromfile(str(job / 'search_llama.py'))
    winner = Config.fromfile(str(out / 'search_llama_best_2ranks.py'))
    for key in ('parallel', 'activation_checkpointing', 'train_dataloader'):
        assert ran.get(key) == winner.get(key), key


def test_search_reports_when_nothing_fits(tmp_path):
    proc = run_tool(['python', 'tools/plan.py', TINY, '--world-size', 2,
                     '--search', '--memory-budget', '0.05',
                     '--checkpointing', 'none', '--schedules', '1F1B',
                     '--microbatches', 2, '--out', tmp_path], check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert 'no layout of 2 ranks fits --memory-budget 0.05 GiB per rank: ' \
        'the smallest predicted peak is' in proc.stdout
    assert 'the budget must exceed' in proc.stdout
    assert '0 to run' in proc.stderr  # nothing was trained
    assert not list(tmp_path.glob('*.py'))


def test_search_flags_are_refused_at_start_up_with_their_names():
    from mmpar.analysis.job_search import search_then_config
    from mmpar.cli import parse_train_args, train_config
    with pytest.raises(SystemExit):  # argparse: --search-only needs --search
        parse_train_args([TINY, '--search-only'])
    args = parse_train_args([str(ROOT / TINY), '--search', '--trial-steps',
                             '0'])
    with pytest.raises(ValueError, match=r'--trial-steps=0 is not allowed; '
                       r'allowed: an int >= 1'):
        search_then_config(train_config(args), args)
    for flag, shown, allowed in (('--memory-budget', '-1.0', 'GiB > 0'),
                                 ('--sweep', '-1', 'an int >= 0')):
        args = parse_train_args([str(ROOT / TINY), '--search', flag, '-1'])
        with pytest.raises(ValueError, match=f'{flag}={shown} is not '
                           f'allowed; allowed: {allowed}'):
            search_then_config(train_config(args), args)
    args = parse_train_args([str(ROOT / TINY), '--search'])
    with pytest.raises(ValueError, match=r"--search needs a launched job .*"
                       r"got --launcher 'none'"):
        search_then_config(train_config(args), args)


def test_the_plan_front_hands_every_search_flag_to_the_job():
    """``tools/plan.py --search`` is a front: its search flags, handed to
    the launched ``tools/train.py`` (:func:`search_flags`), parse there to
    the same values."""
    from mmpar.analysis.plan_report import parse_args
    from mmpar.analysis.search_args import search_flags
    from mmpar.cli import parse_train_args
    front = parse_args([TINY, '--world-size', '4', '--search',
                        '--memory-budget', '1.5', '--trial-steps', '3',
                        '--warmup-steps', '4', '--early-stop', '0',
                        '--confirm', '2', '--confirm-rounds', '5',
                        '--sweep', '2', '--checkpointing', 'none', 'full',
                        '--schedules', 'GPipe', '--microbatches', '4', '8',
                        '--out', 'somewhere'])
    job = parse_train_args([TINY, '--search', '--search-only',
                            *search_flags(front)])
    names = ('memory_budget', 'trial_steps', 'warmup_steps', 'early_stop',
             'confirm', 'confirm_rounds', 'sweep', 'checkpointing',
             'schedules', 'microbatches', 'out')
    assert {n: getattr(job, n) for n in names} == \
        {n: getattr(front, n) for n in names}
    defaults = parse_train_args([TINY, '--search'])
    # Every value above differs from the job's default: none passed by luck.
    assert all(getattr(job, n) != getattr(defaults, n) for n in names)
