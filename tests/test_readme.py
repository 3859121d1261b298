"""The README's test command is the one CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND = 'pip install -r requirements-test.txt -e . && python -m pytest'


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in (ROOT / 'README.md').read_text()
    ci_lines = (ROOT / '.ci' / 'run').read_text().splitlines()
    assert TEST_COMMAND in ci_lines
