"""The guide cannot rot: commands in README.md and docs/ name files that
exist and parse with the tools' own argument parsers; Python blocks compile;
local links resolve."""
import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from mmpar import cli
from mmpar.datasets.prepare import parse_args as parse_prepare_args
from mmpar.generation import parse_generate_args
from mmpar.verify.cli import parse_verify_args

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md'] + sorted((ROOT / 'docs').rglob('*.md'))
BLOCK = re.compile(r'```(\w+)\n(.*?)```', re.S)
PARSERS = {
    'tools/train.py': cli.parse_train_args,
    'tools/test.py': cli.parse_test_args,
    'tools/generate.py': parse_generate_args,
    'tools/prepare_data.py': parse_prepare_args,
    'tools/verify.py': parse_verify_args,
}


def _blocks(language):
    for page in PAGES:
        for lang, body in BLOCK.findall(page.read_text()):
            if lang == language:
                yield page, body


def _commands():
    for page, body in _blocks('bash'):
        for command in body.replace('\\\n', ' ').splitlines():
            command = command.split('  #')[0].strip()
            if command and not command.startswith('#'):
                yield pytest.param(page, command,
                                   id=f'{page.name}:{command[:60]}')


def _words(command):
    words = shlex.split(command)
    # Drop leading VAR=value environment assignments.
    while words and re.match(r'^\w+=', words[0]):
        words.pop(0)
    return words


@pytest.mark.parametrize('page,command', list(_commands()))
def test_documented_command_is_valid(page, command):
    for part in command.split('&&'):
        words = _words(part)
        if not words:
            continue
        for word in words:
            if re.match(r'^(configs|tools|benchmarks|tests)/[\w/.-]+\.\w+$',
                        word):
                assert (ROOT / word).exists(), f'{page.name}: {word} missing'
        if words[0] == 'pip':
            for i, word in enumerate(words):
                if word == '-r':
                    assert (ROOT / words[i + 1]).is_file(), words[i + 1]
        if words[0] == 'python' and words[1] in PARSERS:
            args = [w for w in words[2:] if '*' not in w and '<' not in w]
            try:
                PARSERS[words[1]](args)
            except SystemExit as exit_:
                pytest.fail(f'{page.name}: `{part}` does not parse ({exit_})')


@pytest.mark.parametrize(
    'page,body',
    [pytest.param(p, b, id=f'{p.name}:{i}')
     for i, (p, b) in enumerate(_blocks('python'))])
def test_python_block_compiles(page, body):
    # A block that does not parse raises SyntaxError here; one that
    # imports a name mmpar no longer has fails below.
    tree = ast.parse(compile(body, str(page), 'exec', ast.PyCF_ONLY_AST))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
                node.module or '').split('.')[0] == 'mmpar':
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), (
                    f'{page.name}: from {node.module} import {alias.name}: '
                    'no such name')


@pytest.mark.parametrize('page', PAGES, ids=lambda p: p.name)
def test_local_links_resolve(page):
    for target in re.findall(r'\]\(([^)#\s]+)', page.read_text()):
        if '://' in target:
            continue
        assert (page.parent / target).exists(), f'{page.name} -> {target}'
