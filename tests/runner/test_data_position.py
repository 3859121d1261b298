"""Resume at the exact sample on another number of data ranks: the samplers
continue the global order; an iteration-based run resumed with another
global batch continues at the saved sample, an epoch resumed in its middle
with another global batch is refused.

The end-to-end check through the tools (4 -> 2 -> 4 ranks, sample ids
recorded) is tests/tools/test_resize_resume.py.
"""
import itertools
from types import SimpleNamespace

import pytest

from mmpar.failures import ConfigError
from mmpar.runner.data_position import restore_position
from mmpar.runner.loops import (FastResumeIterBasedTrainLoop,
                                SkippableDefaultSampler,
                                SkippableInfiniteSampler)
from tests.runner.test_iter_resume import _Sized


def _samplers(cls, world_size, monkeypatch, **kwargs):
    from mmengine.dataset import sampler as mmengine_sampler
    samplers = []
    for rank in range(world_size):
        monkeypatch.setattr(mmengine_sampler, 'get_dist_info',
                            lambda rank=rank: (rank, world_size))
        samplers.append(cls(seed=3, **kwargs))
    return samplers


def _batches(samplers, batch_size, num_iters=None):
    """The ids each iteration reads over all ranks (rank order)."""
    streams = [iter(s) for s in samplers]
    batches = []
    for _ in itertools.count() if num_iters is None else range(num_iters):
        batch = [i for s in streams for i in itertools.islice(s, batch_size)]
        if not batch:
            return batches
        batches.append(sorted(batch))
    return batches


@pytest.mark.parametrize('size,round_up', [(96, True), (99, True),
                                           (99, False)])
@pytest.mark.parametrize('before,after', [(4, 2), (2, 4)])
def test_epoch_resized_after_k_iterations_reads_each_id_once(
        size, round_up, before, after, monkeypatch):
    """k iterations at ``before`` ranks, the rest of the epoch at ``after``
    with the same global batch (16): the same global batches, every id of
    the epoch once (and round_up's repeats only at the end)."""
    kwargs = dict(dataset=_Sized(size), shuffle=True, round_up=round_up)
    global_batch = 16
    straight = _batches(_samplers(SkippableDefaultSampler, before,
                                  monkeypatch, **kwargs),
                        global_batch // before)
    for k in (1, 3):
        resumed = _samplers(SkippableDefaultSampler, after, monkeypatch,
                            **kwargs)
        for sampler in resumed:
            sampler.skip(k * global_batch)
        rest = _batches(resumed, global_batch // after)
        # Full iterations are the same samples; the epoch's last partial
        # one holds the same ids less the other world size's padding.
        assert rest[:-1] == straight[k:-1]
        epoch = [i for batch in straight[:k] + rest for i in batch]
        assert set(epoch) == set(range(size))
        # Ids repeat only as round_up's padding (of the resumed world size).
        padding = -size % after if round_up else 0
        assert len(epoch) == size + padding
        # The skip holds for one epoch: the next one is whole.
        assert sum(len(list(s)) for s in resumed) == size + padding


@pytest.mark.parametrize('before,after', [(4, 2), (2, 4)])
def test_iteration_stream_resized_continues_the_global_order(
        before, after, monkeypatch):
    global_batch, k = 8, 5
    straight = _batches(_samplers(SkippableInfiniteSampler, before,
                                  monkeypatch, dataset=_Sized(13)),
                        global_batch // before, num_iters=k + 6)
    resumed = _samplers(SkippableInfiniteSampler, after, monkeypatch,
                        dataset=_Sized(13))
    for sampler in resumed:
        # What FastResumeIterBasedTrainLoop asks: iter * batch_size.
        sampler.skip(k * global_batch // after)
    assert _batches(resumed, global_batch // after, num_iters=6) == \
        straight[k:]


class _Loop:
    """An epoch loop's resume entry point, recording what it is told."""

    def __init__(self):
        self.told = []

    def resume_within_epoch(self, num_samples):
        self.told.append(num_samples)


def _runner(batch_size, num_data_ranks, loop, it=4):
    return SimpleNamespace(
        topology=SimpleNamespace(dp_size=num_data_ranks), iter=it,
        train_loop=loop,
        train_dataloader=SimpleNamespace(batch_size=batch_size))


def test_mid_epoch_resume_with_another_global_batch_is_refused():
    saved = dict(global_batch=16, epoch_samples=32)
    loop = _Loop()
    restore_position(_runner(8, 2, loop), saved)  # 2 ranks x 8: resumes
    assert loop.told == [32]
    with pytest.raises(ConfigError) as err:
        restore_position(_runner(4, 2, _Loop()), saved)
    message = str(err.value)
    assert 'train_dataloader.batch_size=4 on 2 data ranks reads 8' in message
    assert 'Allowed: train_dataloader.batch_size=8' in message
    with pytest.raises(ConfigError, match='a number of data ranks that '
                       'divides 16'):
        restore_position(_runner(4, 3, _Loop()), saved)


class _IterLoop:
    """An iteration loop's resume entry point, recording what it is told."""

    def __init__(self):
        self.told = []

    def resume_at_sample(self, num_samples):
        self.told.append(num_samples)


def _skip_as_the_loop(sampler, iteration, batch_size, saved_samples):
    """FastResumeIterBasedTrainLoop's skip on ``sampler``'s rank."""
    import torch.utils.data
    loop = FastResumeIterBasedTrainLoop.__new__(FastResumeIterBasedTrainLoop)
    loop._iter = iteration
    loop.dataloader = torch.utils.data.DataLoader(
        list(range(13)), batch_size=batch_size, sampler=sampler)
    loop.resume_at_sample(saved_samples)
    loop._skip_trained_batches()


@pytest.mark.parametrize('before,after', [(4, 2), (2, 4)])
def test_iteration_resume_with_another_global_batch_goes_on_at_the_sample(
        before, after, monkeypatch):
    loop = _IterLoop()
    restore_position(_runner(4, 2, loop),
                     dict(global_batch=16, epoch_samples=None))
    assert loop.told == [4 * 16]  # iteration 4 of a global batch of 16
    # Saved after 5 iterations of 2 per rank (global batch 2 x before); the
    # resumed run reads 3 per rank (3 x after): its stream starts at the
    # saved run's 5 x 2 x before-th global sample.
    k, saved_batch = 5, 2 * before
    straight = _batches(_samplers(SkippableInfiniteSampler, before,
                                  monkeypatch, dataset=_Sized(13)), 2,
                        num_iters=k + 12)
    resumed = _samplers(SkippableInfiniteSampler, after, monkeypatch,
                        dataset=_Sized(13))
    for sampler in resumed:
        _skip_as_the_loop(sampler, k, 3, k * saved_batch)
    # Compared as multisets of consecutive global positions: the ranks
    # interleave within an iteration.
    after_ids = [i for b in _batches(resumed, 3, num_iters=4) for i in b]
    straight_ids = [i for b in straight for i in b][k * saved_batch:]
    assert sorted(after_ids) == sorted(straight_ids[:len(after_ids)])
    # A sample count the data ranks cannot split is refused.
    with pytest.raises(ConfigError, match='a number of data ranks that '
                       'divides 7'):
        _skip_as_the_loop(resumed[0], 1, 3, 7)


def test_resume_at_an_epoch_boundary_may_change_the_global_batch():
    loop = _Loop()
    restore_position(_runner(4, 2, loop),
                     dict(global_batch=16, epoch_samples=0))
    restore_position(_runner(4, 2, loop), None)  # an older checkpoint
    assert loop.told == []


# A tiny digits run that records the ids each iteration reads.
RECORDED = '''_base_ = ['{base}']
custom_imports = dict(imports=['tests.sample_recording'],
                      allow_failed_imports=False)
model = dict(depth=1, embed_dim=16, num_heads=2)
train_dataloader = dict(batch_size=8, dataset=dict(
    type='RecordedDigits', num_samples={num_samples}, split='train'))
train_cfg = dict({loop}, val_interval=1000)
val_dataloader = val_cfg = val_evaluator = None
param_scheduler = []
default_hooks = dict(checkpoint=dict(by_epoch=False, interval={interval},
                                     max_keep_ckpts=-1))
custom_hooks = [dict(type='RecordSamples')]
'''
ITERATIONS = "_delete_=True, by_epoch=False, max_iters=6"
# MMEngine's default: a random seed a run.
SEEDLESS = RECORDED + 'randomness = dict(seed=None)\n'


@pytest.mark.parametrize('base,loop', [
    ('vit_digits_iter.py', ITERATIONS),
    ('vit_digits.py', 'by_epoch=True, max_epochs=2'),
], ids=['iterations', 'epochs'])
def test_a_run_without_a_seed_resumes_in_its_own_order(tmp_path, base,
                                                       loop):
    """Without a configured seed each run's sampler draws its own; the
    resumed run reads on in the saved run's order, not in a new one."""
    from tests.e2e import ROOT, run_tool
    from tests.sample_recording import read_records
    config = tmp_path / 'seedless.py'
    config.write_text(SEEDLESS.format(
        base=ROOT / 'configs/vit_digits' / base, loop=loop, num_samples=40,
        interval=3))
    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    run_tool(['python', 'tools/train.py', config, '--work-dir', straight])
    run_tool(['python', 'tools/train.py', config, '--work-dir', resumed,
              '--resume', straight / 'iter_3.pth'])
    read, reread = read_records(straight), read_records(resumed)
    assert sorted(reread) == [it for it in sorted(read) if it > 3]
    for it in reread:
        assert reread[it][0] == read[it][0], it



def test_a_second_resume_after_a_batch_change_reads_on(tmp_path):
    """A reads 3 iterations of 8; B resumes it with batch 16 (sample 24
    on); C resumes B's iteration 4 with B's batch: it must read what B read
    next (sample 40 on), not iteration x batch (64) on."""
    from tests.e2e import ROOT, run_tool
    from tests.sample_recording import read_records
    config = tmp_path / 'iterations.py'
    config.write_text(RECORDED.format(
        base=ROOT / 'configs/vit_digits/vit_digits_iter.py', loop=ITERATIONS,
        num_samples=200, interval=1))
    a, b, c = (tmp_path / name for name in 'abc')
    run_tool(['python', 'tools/train.py', config, '--work-dir', a,
              '--cfg-options', 'train_cfg.max_iters=3'])
    batch16 = ['--cfg-options', 'train_dataloader.batch_size=16']
    run_tool(['python', 'tools/train.py', config, '--work-dir', b,
              '--resume', a / 'iter_3.pth'] + batch16)
    run_tool(['python', 'tools/train.py', config, '--work-dir', c,
              '--resume', b / 'iter_4.pth'] + batch16)
    read_b, read_c = read_records(b), read_records(c)
    assert sorted(read_c) == [5, 6]
    for it in read_c:
        assert read_c[it][0] == read_b[it][0], it
