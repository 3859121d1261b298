"""Test-only recorders, loaded into a run with ``custom_imports``: which
sample ids each rank trains on at each iteration, and its loss; how many
samples an evaluation counted.

``RecordedDigits`` remembers the ids it reads (``num_workers=0``: in the
rank's own process); ``RecordSamples`` writes, after every train iteration,
one JSON line per rank to ``WORK_DIR/samples_rank{R}.jsonl``;
``RecordTokens`` writes the token rows (``inputs``) each rank trained on at
each iteration to ``WORK_DIR/tokens_rank{R}.jsonl``; ``CountSamples`` is a metric whose value is the number of results it got.
"""
import json
import os

from mmengine.dist import get_rank, get_world_size
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook

from mmpar.datasets import DigitsDataset
from mmpar.registry import DATASETS, HOOKS, METRICS


@DATASETS.register_module()
class RecordedDigits(DigitsDataset):
    """The first ``num_samples`` items of ``DigitsDataset``; ``read`` lists
    the ids read since the recorder last emptied it."""

    def __init__(self, num_samples=None, **kwargs):
        super().__init__(**kwargs)
        self.num_samples = num_samples or len(self.labels)
        self.read = []

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        self.read.append(int(idx))
        return super().__getitem__(idx)


@HOOKS.register_module()
class RecordSamples(Hook):
    """After each train iteration: ``{"iter", "world", "ids", "loss"}``."""

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        dataset = runner.train_dataloader.dataset
        line = dict(iter=runner.iter + 1, world=get_world_size(),
                    batch_idx=batch_idx, ids=dataset.read,
                    loss=float(outputs['loss']))
        dataset.read = []
        path = os.path.join(runner.work_dir, f'samples_rank{get_rank()}.jsonl')
        with open(path, 'a') as f:
            f.write(json.dumps(line) + '\n')


@HOOKS.register_module()
class RecordTokens(Hook):
    """After each train iteration: ``{"iter", "world", "rows"}``, the token
    ids of the batch this rank trained on (any dataset whose items have
    ``inputs``)."""

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        line = dict(iter=runner.iter + 1, world=get_world_size(),
                    rows=data_batch['inputs'].tolist())
        path = os.path.join(runner.work_dir, f'tokens_rank{get_rank()}.jsonl')
        with open(path, 'a') as f:
            f.write(json.dumps(line) + '\n')


@METRICS.register_module()
class CountSamples(BaseMetric):
    """``count``: the results collected over all ranks (after MMEngine drops
    the sampler's padding), and ``labels``: the sum of their labels."""

    def process(self, data_batch, data_samples):
        self.results.extend(int(s['gt_label']) for s in data_samples)

    def compute_metrics(self, results):
        return dict(count=len(results), labels=sum(results))


def _records_by_iter(work_dir, prefix: str) -> dict:
    """``{iter: [record of each rank]}`` from the ``{prefix}{rank}.jsonl``
    files of one run."""
    by_iter = {}
    for name in sorted(os.listdir(work_dir)):
        if name.startswith(prefix):
            with open(os.path.join(work_dir, name)) as f:
                for line in f:
                    record = json.loads(line)
                    by_iter.setdefault(record['iter'], []).append(record)
    return by_iter


def read_records(work_dir) -> dict:
    """``{iter: (ids of all ranks, mean loss over ranks)}`` of one run."""
    return {
        it: ([i for r in records for i in r['ids']],
             sum(r['loss'] for r in records) / len(records))
        for it, records in _records_by_iter(work_dir, 'samples_rank').items()
    }


def read_token_rows(work_dir) -> dict:
    """``{iter: sorted token rows of all ranks}`` of one run (written by
    ``RecordTokens``): the token stream of each iteration, whatever rank
    read which row."""
    return {
        it: sorted(row for r in records for row in r['rows'])
        for it, records in _records_by_iter(work_dir, 'tokens_rank').items()
    }
