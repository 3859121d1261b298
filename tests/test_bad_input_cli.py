"""A few catalogue cases through tools/train.py: exit code 1 or 2 before any
training, one message naming key, value and what is allowed, no traceback."""
import pytest

from tests.e2e import DEFAULT_CONFIG, run_tool

CASES = {
    'pair without =': (['train_cfg.max_epochs'],
                       ["'train_cfg.max_epochs' is not KEY=VALUE"]),
    'dict in --cfg-options': (["custom_hooks=[dict(type=X,rank=1)]"],
                              ["cannot parse the value of 'custom_hooks'",
                               'put dicts in a config file']),
    'missing custom_imports module': (
        ['custom_imports.imports=[mmpar_plugins_nope]'],
        ["custom_imports.imports='mmpar_plugins_nope'",
         'cannot be imported']),
    # (nccl without CUDA is no longer refused: the Runner warns and uses
    # gloo; tests/runner/test_plain_configs.py.)
    'tp and model_parallelism disagree': (
        ['parallel.tp=2', 'parallel.model_parallelism=4',
         'parallel.tp_plan=digits_vit'],
        ['parallel.tp=2 and parallel.model_parallelism=4 disagree']),
    'unknown wrapper': (['model_wrapper_cfg.type=MMNope'],
                        ["model_wrapper_cfg.type='MMNope'",
                         'MMDistributedDataParallel']),
    'typo in train_cfg': (['train_cfg.max_epoch=3'],
                          ["unknown key 'max_epoch'", 'max_epochs']),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_train_rejects_bad_config_at_start(case, tmp_path):
    options, expected = CASES[case]
    proc = run_tool(['python', 'tools/train.py', DEFAULT_CONFIG, '--work-dir',
                     tmp_path, '--cfg-options'] + options,
                    timeout=120,
                    check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode in (1, 2), output[-2000:]
    for text in expected:
        assert text in output, output[-2000:]
    assert 'Traceback' not in output, output[-3000:]
    assert 'Epoch(train)' not in output


def test_test_refuses_a_checkpoint_without_the_models_weights(tmp_path):
    """tools/test.py evaluates the checkpoint given: one that lacks the
    model's parameters (another model's) is refused, not evaluated at the
    random initialisation with exit 0."""
    import torch
    other = tmp_path / 'other_model.pth'
    torch.save(dict(state_dict={'tok_embeddings.weight': torch.zeros(4, 2),
                                'norm.weight': torch.ones(2)}), other)
    proc = run_tool(['python', 'tools/test.py', DEFAULT_CONFIG, other,
                     '--work-dir', tmp_path / 'work'], timeout=120,
                    check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-2000:]
    assert f'{other} lacks' in output and 'parameters of DigitsViT' in output
    assert 'Traceback' not in output, output[-3000:]
    assert 'Epoch(test)' not in output


PLAN_CASES = {
    'missing config': (['nope.py', '--world-size', '2'],
                       "config 'nope.py' does not exist"),
    'pair without =': ([DEFAULT_CONFIG, '--world-size', '2',
                        '--cfg-options', 'model.depth'],
                       "'model.depth' is not KEY=VALUE"),
    'world size 0': ([DEFAULT_CONFIG, '--world-size', '0'],
                     '--world-size=0 is not a number of ranks; allowed: 1 '
                     'or more'),
    'rank outside the world': ([DEFAULT_CONFIG, '--world-size', '2',
                                '--rank', '2'],
                               '--rank=2 is outside --world-size=2; '
                               'allowed: 0 to 1'),
}


@pytest.mark.parametrize('case', sorted(PLAN_CASES))
def test_plan_rejects_bad_arguments(case):
    """tools/plan.py: exit 2 as argparse does, one line naming the argument,
    the value and what is allowed, no traceback."""
    args, expected = PLAN_CASES[case]
    proc = run_tool(['python', 'tools/plan.py'] + args, timeout=120,
                    check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert 'plan.py: error: ' in proc.stderr and expected in proc.stderr, \
        output[-2000:]
    assert 'Traceback' not in output, output[-3000:]


@pytest.mark.parametrize('script,args,usage', [
    ('dist_train.sh', [DEFAULT_CONFIG], 'CONFIG NPROC [train.py options]'),
    ('dist_verify.sh', [DEFAULT_CONFIG],
     'CONFIG NPROC [verify.py options]'),
    ('dist_test.sh', [DEFAULT_CONFIG, 'x.pth'],
     'CONFIG CHECKPOINT NPROC [test.py options]'),
])
def test_dist_scripts_without_nproc_print_their_usage(script, args, usage):
    """No torchrun starts: the usage line and exit 2, not set -u's
    '$2: unbound variable'; --help prints the usage and exits 0."""
    proc = run_tool(['bash', f'tools/{script}'] + args, timeout=60,
                    check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f'usage: bash tools/{script} {usage}',
        f'{script}: error: missing NPROC']
    helped = run_tool(['bash', f'tools/{script}', '--help'], timeout=60,
                      check=False)
    assert (helped.returncode, helped.stdout) == \
        (0, f'usage: bash tools/{script} {usage}\n')


def test_train_refuses_token_ids_past_the_models_vocabulary(tmp_path):
    # Byte tokens (256 ids) into a Llama of 128: an index error deep in the
    # embedding at the first batch, before.
    proc = run_tool(['python', 'tools/train.py',
                     'configs/llama_shakespeare/llama_sft.py', '--work-dir',
                     tmp_path, '--cfg-options', 'model.vocab_size=128'],
                    timeout=120, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-2000:]
    assert 'train_dataloader.dataset: its tokenizer gives ids 0 to 255, ' \
        'but the model has vocab_size=128' in output, output[-2000:]
    assert 'Traceback' not in output, output[-3000:]
    assert 'Iter(train)' not in output and 'Epoch(train)' not in output
