"""tools/generate.py: loads full and sharded checkpoints into the plain model
and prints the same text for the same seed."""
import pytest

from mmpar.generation import generate, main, parse_generate_args
from tests.configs.test_llama_configs import SHRINK, _train, _train_dist
from tests.e2e import run_tool

CONFIG = 'configs/llama_shakespeare/llama_shakespeare.py'
FSDP2_CONFIG = 'configs/llama_shakespeare/llama_shakespeare_fsdp2.py'
MODEL_OPTS = [f'{k}={v}' for k, v in SHRINK.items() if k.startswith('model')]


@pytest.fixture(scope='module')
def full_checkpoint(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('generate_full')
    _train(CONFIG, work_dir, 'generate_full', max_iters=4)
    return str(work_dir / 'iter_4.pth')


def _generate(checkpoint, *extra, config=CONFIG):
    return main([config, checkpoint, '--prompt', 'ROMEO:',
                 '--max-new-tokens', '40', '--top-k', '20', *extra,
                 '--cfg-options', *MODEL_OPTS])


def test_same_seed_same_text(full_checkpoint):
    a = _generate(full_checkpoint, '--seed', '3')
    b = _generate(full_checkpoint, '--seed', '3')
    c = _generate(full_checkpoint, '--seed', '4')
    assert a == b and a != c
    assert a.startswith('ROMEO:')
    greedy = [_generate(full_checkpoint, '--temperature', '0', '--seed', s)
              for s in ('1', '2')]
    assert greedy[0] == greedy[1]


def test_cli_prints_the_text(full_checkpoint):
    proc = run_tool(['python', 'tools/generate.py', CONFIG, full_checkpoint,
                     '--prompt', 'ROMEO:', '--max-new-tokens', '20',
                     '--seed', '3', '--cfg-options', *MODEL_OPTS])
    expected = main([CONFIG, full_checkpoint, '--prompt', 'ROMEO:',
                     '--max-new-tokens', '20', '--seed', '3',
                     '--cfg-options', *MODEL_OPTS])
    assert proc.stdout == expected + '\n'


def test_sharded_checkpoint_directory(run_dist, tmp_path):
    run_dist(_train_dist, FSDP2_CONFIG, tmp_path, 'generate_sharded', 2)
    text = _generate(str(tmp_path / 'iter_2'), '--seed', '5',
                     config=FSDP2_CONFIG)
    assert text.startswith('ROMEO:') and len(text.encode()) >= 6 + 20


def test_top_k_one_is_greedy(full_checkpoint):
    from mmpar.generation import load_model
    model = load_model(CONFIG, full_checkpoint,
                       {k: v for k, v in SHRINK.items()
                        if k.startswith('model')})
    prompt = list(b'ROMEO:')
    assert generate(model, prompt, 15, top_k=1, seed=1) == generate(
        model, prompt, 15, temperature=0)


@pytest.mark.parametrize('args,match', [
    (['--max-new-tokens', '-1'], '--max-new-tokens=-1'),
    (['--temperature', '-0.5'], '--temperature=-0.5'),
    (['--top-k', '0'], '--top-k=0'),
    (['--prompt', ''], '--prompt is empty'),
])
def test_bad_arguments_name_the_flag(args, match, capsys):
    with pytest.raises(SystemExit):
        parse_generate_args([CONFIG, 'x.pth', *args])
    assert match in capsys.readouterr().err


def test_missing_checkpoint_names_it():
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        main([CONFIG, 'nope.pth'])
