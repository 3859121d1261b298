"""``--against`` without training: the layouts it accepts, the reference
config each makes, and the default under ``--memory-budget`` (mmpar's
memory plan on the meta device)."""
import pytest
from mmengine.config import Config

from mmpar.failures import ConfigError
from mmpar.verify.against import parse_against
from mmpar.verify.choose import choose_reference
from mmpar.verify.run import reference_config
from tests.e2e import ROOT

TP_CUSTOM = 'configs/vit_digits/vit_digits_tp_custom.py'
LLAMA_TP = 'configs/llama_shakespeare/llama_shakespeare_tp.py'
MOE = 'configs/llama_shakespeare/llama_shakespeare_moe.py'


def test_parallel_reference_config():
    cfg = Config.fromfile(str(ROOT / TP_CUSTOM))  # tp=2: 1 data rank
    ref = reference_config(cfg, 2, 'dp_shard=2,wrapper=MMFullyShard')
    assert ref.parallel == dict(dp_shard=2)  # the tp plan dropped
    assert ref.model_wrapper_cfg == dict(type='MMFullyShard')
    # The same global batch over the reference's 2 data ranks.
    assert ref.train_dataloader.batch_size * 2 == \
        cfg.train_dataloader.batch_size
    assert cfg.parallel.tp == 2  # the user's config is not changed
    assert parse_against(' pp=2, dp_shard=2').label == 'dp_shard=2,pp=2'
    # Expert ranks read different samples too: ep=2 halves the batch.
    moe = Config.fromfile(str(ROOT / MOE))  # DDP: 2 data ranks at 2
    ref = reference_config(moe, 2, 'ep=2,wrapper=MMFullyShard')
    assert ref.parallel == dict(ep=2)
    assert ref.train_dataloader.batch_size == \
        moe.train_dataloader.batch_size
    for bad, why in (('dp_shard=3', 'does not split over its 3 data ranks'),
                     ('pp=2', "pp needs the config's parallel.pipeline"),
                     ('dp_shard=2,wrapper=Nope',
                      "'Nope' is not a registered")):
        with pytest.raises(ConfigError, match='allowed') as err:
            reference_config(cfg, 2, bad)
        assert f'--against={bad!r}: ' in str(err.value)
        assert why in str(err.value), str(err.value)


def test_memory_budget_falls_back_to_the_smallest_layout_that_fits():
    # A Llama of 100M parameters: AdamW and the activations of 16 windows
    # of 256 tokens need about 7 GiB in one process, 4.6 at dp_shard=2
    # (FSDP2: the config's DDP would replicate), 2.9 at dp_shard=4.
    cfg = Config.fromfile(str(ROOT / LLAMA_TP))
    cfg.merge_from_dict({'model.dim': 1024, 'model.num_layers': 8})
    assert choose_reference(cfg, 4, 'one-process', None) == 'one-process'
    assert choose_reference(cfg, 4, 'one-process', 100) == 'one-process'
    assert choose_reference(cfg, 4, 'one-process', 6) == \
        'dp_shard=2,wrapper=MMFullyShard'
    # A layout given is taken as it is.
    assert choose_reference(cfg, 4, 'dp_shard=4', 6) == 'dp_shard=4'
    with pytest.raises(ConfigError, match='--memory-budget=0.5: no ') as err:
        choose_reference(cfg, 4, 'one-process', 0.5)
    assert 'dp_shard=4,wrapper=MMFullyShard: ' in str(err.value)
    assert 'allowed: a larger budget, or --against LAYOUT' in str(err.value)


def test_parallel_reference_needs_its_launch(tmp_path):
    # python tools/verify.py ... --reference-world 2 --against dp_shard=2
    # without torchrun: refused, saying how to launch it.
    from mmpar.verify.cli import verify_main
    with pytest.raises(ConfigError, match='--nproc_per_node 2') as err:
        verify_main([str(ROOT / TP_CUSTOM), '--reference-world', '2',
                     '--against', 'dp_shard=2', '--work-dir',
                     str(tmp_path)])
    assert "--against='dp_shard=2': the reference runs on 2 ranks" in \
        str(err.value)
    assert not any(tmp_path.iterdir())  # nothing trained
