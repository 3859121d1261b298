"""A context-parallel layout that cannot train fails at start-up, before
any process group, naming the key: cp not dividing the world, a sequence
length not a multiple of 2 x cp, a model without the protocol."""
import pytest
from mmengine.config import Config

from mmpar.config_check import check_config
from mmpar.failures import ConfigError

LLAMA = 'configs/llama_shakespeare/llama_shakespeare.py'
VIT = 'configs/vit_digits/vit_digits_iter.py'


def _check(path, world_size, **parallel):
    cfg = Config.fromfile(path)
    cfg.merge_from_dict({f'parallel.{k}': v for k, v in parallel.items()})
    return check_config(cfg, world_size)


def test_llama_cp_layouts_pass():
    dims = _check(LLAMA, 8, cp=4).dims
    assert (dims.dp, dims.cp) == (2, 4)
    dims = _check(LLAMA, 4, cp=2, tp=2, tp_plan='llama').dims
    assert (dims.dp, dims.cp, dims.tp) == (1, 2, 2)


@pytest.mark.parametrize('path,world_size,parallel,named', [
    (LLAMA, 6, dict(cp=4), ['parallel.cp=4 does not divide the world size '
                            '6; allowed: one of 1, 2, 3, 6']),
    # 128 tokens in 2 x 3 chunks: no.
    (LLAMA, 6, dict(cp=3), ['train_dataloader.dataset.context_length=128 '
                            'is not allowed; with parallel.cp=3 each '
                            'sequence is cut into 2 x cp = 6 equal chunks',
                            'allowed: a multiple of 6']),
    (VIT, 2, dict(cp=2), ["parallel.cp=2 is not allowed; model.type="
                          "'DigitsViT' has no context-parallel protocol",
                          'allowed: parallel.cp=1, or a model that '
                          'declares it']),
])
def test_bad_cp_layouts_name_the_key(path, world_size, parallel, named):
    with pytest.raises(ConfigError) as err:
        _check(path, world_size, **parallel)
    for text in named:
        assert text in str(err.value)


def test_dataset_default_length_is_checked():
    # No context_length in the section: the data set's default (128) counts.
    cfg = Config.fromfile(LLAMA)
    del cfg.train_dataloader.dataset['context_length']
    del cfg.val_dataloader.dataset['context_length']
    cfg.test_dataloader = cfg.val_dataloader
    cfg.merge_from_dict({'parallel.cp': 3})
    with pytest.raises(ConfigError, match=r'train_dataloader.dataset.'
                       r'context_length=128 is not allowed'):
        check_config(cfg, 6)


def _with_length(length, world_size, **parallel):
    cfg = Config.fromfile(LLAMA)
    cfg.merge_from_dict({f'parallel.{k}': v for k, v in parallel.items()})
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.context_length = length
    return check_config(cfg, world_size)


@pytest.mark.parametrize('length,world_size,parallel,named', [
    # The sequence-parallel plan splits the sequence over tp: 15 tokens on
    # 2 tp ranks failed in the first call's dry run, misleadingly.
    (15, 2, dict(tp=2), ['train_dataloader.dataset.context_length=15 is '
                         "not allowed; parallel.tp_plan='llama' splits the "
                         'sequence over parallel.tp=2',
                         'allowed: a multiple of 2', "'llama_no_sp'"]),
    # cp=2 first: 12 = 2 x 2 x 3 chunks, each cp rank's 6 tokens over tp=4.
    (12, 8, dict(cp=2, tp=4), ["splits each cp rank's 6 tokens "
                               '(parallel.cp=2) over parallel.tp=4',
                               'allowed: a multiple of 8']),
])
def test_sequence_parallel_lengths_divide_by_tp(length, world_size,
                                                parallel, named):
    with pytest.raises(ConfigError) as err:
        _with_length(length, world_size, tp_plan='llama', **parallel)
    for text in named:
        assert text in str(err.value)


@pytest.mark.parametrize('length,world_size,parallel', [
    (16, 2, dict(tp=2, tp_plan='llama')),
    (8, 8, dict(cp=2, tp=4, tp_plan='llama')),  # 4 tokens per cp rank
    (15, 2, dict(tp=2, tp_plan='llama_no_sp')),  # the sequence stays whole
])
def test_lengths_a_sequence_parallel_split_takes_pass(length, world_size,
                                                      parallel):
    _with_length(length, world_size, **parallel)
