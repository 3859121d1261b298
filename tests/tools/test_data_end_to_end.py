"""Your own corpus through the tools: ``tools/prepare_data.py`` writes a
token shard of the shipped Tiny Shakespeare, ``tools/train.py`` trains the
shipped ``llama_corpus.py`` config (shrunk) on it blended with a text file
tokenized on first use into the cache, with packing and document attention,
and ``--resume`` from iteration 2 reaches the straight run's iteration 4 bit
for bit (the data position restored to the sample); resumed on 2 processes
(the same global batch) it trains on the straight run's token rows. The shipped
``llama_sft.py`` (shrunk) fine-tunes through ``tools/dist_train.sh`` on 2
processes on the shipped instruction set, packed with document attention,
shuffled by ``PermutedInfiniteSampler``, and ``--resume`` from iteration 2
reaches the straight run's iteration 4 bit for bit; resumed from there on
one process with the same global batch, and on 2 again, each resumed
iteration trains on exactly the token rows the straight run's did (recorded
by ``tests/sample_recording.RecordTokens``)."""
import json
import re
from pathlib import Path

from tests.e2e import (assert_same_training_state, load_ckpt, run_tool,
                       tool_env)
from tests.sample_recording import read_token_rows

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / 'configs' / 'llama_shakespeare' / 'llama_corpus.py'
SHRINK = [
    'model.dim=32', 'model.num_layers=2', 'model.num_heads=2',
    'train_dataloader.batch_size=4',
    'train_dataloader.dataset.context_length=32',
    'val_dataloader.batch_size=4',
    'val_dataloader.dataset.context_length=32',
    'val_dataloader.dataset.num_windows=8', 'train_cfg.max_iters=4',
    'train_cfg.val_interval=4', 'default_hooks.checkpoint.interval=2',
    'default_hooks.logger.interval=1'
]


def _own_config(tmp_path: Path) -> Path:
    extra = tmp_path / 'extra.txt'
    extra.write_text('\n\n'.join(f'Paragraph {i}: ' + 'words ' * (i % 7 + 3)
                                 for i in range(60)))
    corpus = [dict(shards=str(tmp_path / 'corpus' / 'shakespeare'),
                   weight=3.0),
              dict(files=str(extra), separator='\n\n', weight=1.0)]
    config = tmp_path / 'my_corpus.py'
    config.write_text(
        f'_base_ = [{str(CONFIG)!r}]\n'
        f'corpus = {corpus!r}\n'
        'train_dataloader = dict(dataset=dict(sources=corpus))\n'
        'val_dataloader = dict(dataset=dict(sources=corpus))\n'
        'test_dataloader = val_dataloader\n')
    return _recording(tmp_path, config)


def test_prepare_train_and_resume_on_own_corpus(tmp_path):
    env = tool_env(MMPAR_CACHE=tmp_path / 'cache')
    proc = run_tool(['python', 'tools/prepare_data.py',
                     tmp_path / 'corpus' / 'shakespeare',
                     'mmpar:tinyshakespeare.txt.xz', '--separator', r'\n\n'],
                    env=env)
    header = json.loads(proc.stdout)
    assert header['num_tokens'] > 1_000_000 and header['dtype'] == 'uint16'
    assert header['num_documents'] > 7000  # one per speech
    config = _own_config(tmp_path)
    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    proc = run_tool(['python', 'tools/train.py', config, '--work-dir',
                     straight, '--cfg-options'] + SHRINK, env=env)
    log = proc.stdout + proc.stderr
    assert 'lm/cross_entropy' in log
    # The text file was tokenized once into the cache; the shard was not.
    assert len(list((tmp_path / 'cache' / 'tokens').glob('*.json'))) == 1
    run_tool(['python', 'tools/train.py', config, '--work-dir', resumed,
              '--resume', straight / 'iter_2.pth', '--cfg-options'] + SHRINK,
             env=env)
    assert not (resumed / 'iter_2.pth').exists()  # resumed, not retrained
    assert_same_training_state(load_ckpt(resumed / 'iter_4.pth'),
                               load_ckpt(straight / 'iter_4.pth'))
    two = tmp_path / 'two_ranks'
    run_tool(['bash', 'tools/dist_train.sh', config, 2, '--work-dir', two,
              '--resume', straight / 'iter_2.pth', '--cfg-options'] + SHRINK
             + ['train_dataloader.batch_size=2'], env=env)
    rows = read_token_rows(straight)
    assert sorted(rows) == [1, 2, 3, 4] and len(rows[3]) == 4
    for run in (resumed, two):
        assert read_token_rows(run) == {3: rows[3], 4: rows[4]}, run


SFT_CONFIG = ROOT / 'configs' / 'llama_shakespeare' / 'llama_sft.py'


SFT_SHRINK = [
    'model.dim=32', 'model.num_layers=2', 'model.num_heads=2',
    'train_dataloader.batch_size=2', 'val_dataloader.batch_size=32',
    'train_cfg.max_iters=4', 'train_cfg.val_interval=4',
    'default_hooks.logger.interval=1', 'default_hooks.checkpoint.interval=2'
]


def _recording(tmp_path: Path, base: Path) -> Path:
    """``base`` with ``RecordTokens`` loaded as a user's hook would be."""
    config = tmp_path / f'recorded_{base.name}'
    config.write_text(
        f'_base_ = [{str(base)!r}]\n'
        "custom_imports = dict(imports=['tests.sample_recording'], "
        'allow_failed_imports=False)\n'
        "custom_hooks = [dict(type='RecordTokens')]\n")
    return config


def test_sft_config_through_dist_train(tmp_path):
    """2 ranks, 4 iterations; a resume from iteration 2 reaches the same
    iteration 4 bit for bit (``PermutedInfiniteSampler`` goes on at the
    saved sample), and resumed on one process (batch 4: the same global
    batch) it trains on the same packed token rows."""
    straight, resumed = tmp_path / 'sft', tmp_path / 'resumed'
    one = tmp_path / 'one_process'
    config = _recording(tmp_path, SFT_CONFIG)
    proc = run_tool(['bash', 'tools/dist_train.sh', config, 2,
                     '--work-dir', straight, '--cfg-options', *SFT_SHRINK])
    log = proc.stdout + proc.stderr
    assert "type='SFTDataset'" in log and 'pack=True' in log
    assert 'document_attention=True' in log
    assert "type='PermutedInfiniteSampler'" in log
    # The loss counts answer tokens only: of the 2 ranks x 2 windows x 256
    # inputs, the prompts, padding and system messages are not counted.
    counts = [float(n) for n in re.findall(
        r'Iter\(train\).*? num_tokens: ([\d.]+)', log)]
    assert len(counts) == 4 and all(0 < n < 0.6 * 1024 for n in counts)
    assert 'lm/cross_entropy' in log
    run_tool(['bash', 'tools/dist_train.sh', config, 2, '--work-dir',
              resumed, '--resume', straight / 'iter_2.pth', '--cfg-options',
              *SFT_SHRINK])
    assert not (resumed / 'iter_2.pth').exists()  # resumed, not retrained
    assert_same_training_state(load_ckpt(resumed / 'iter_4.pth'),
                               load_ckpt(straight / 'iter_4.pth'))
    run_tool(['python', 'tools/train.py', config, '--work-dir', one,
              '--resume', straight / 'iter_2.pth', '--cfg-options',
              *SFT_SHRINK, 'train_dataloader.batch_size=4'])
    rows = read_token_rows(straight)
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(len(rows[it]) == 4 for it in rows)  # 2 ranks x 2 windows
    assert len({tuple(r) for it in rows for r in rows[it]}) == 16
    for run in (resumed, one):
        assert read_token_rows(run) == {3: rows[3], 4: rows[4]}, run
