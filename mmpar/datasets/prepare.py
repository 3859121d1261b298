"""``tools/prepare_data.py``: local text / JSONL / Parquet files to a token
shard (the format of :mod:`mmpar.datasets.token_shards`).

    python tools/prepare_data.py OUT_PREFIX FILE_OR_DIR_OR_GLOB ... \\
        [--tokenizer bytes|ShakespeareBPE|HF_DIR] [--text-key text] \\
        [--separator '\\n\\n']

writes ``OUT_PREFIX.bin``, ``.idx`` and ``.json`` and prints the header
with the tokens per second it tokenized.
"""
import argparse
import json
import os.path as osp
import time
from typing import List, Optional

from mmpar.datasets.text_files import expand_files, write_documents
from mmpar.datasets.token_shards import shard_files
from mmpar.datasets.tokenizer import build_tokenizer


def tokenizer_cfg(name: str) -> dict:
    """``--tokenizer`` as a ``TOKENIZERS`` config: ``bytes``, a registered
    name (``ShakespeareBPE``) or a local Hugging Face directory."""
    if name == 'bytes':
        return dict(type='ByteTokenizer')
    if osp.isdir(name):
        return dict(type='HFTokenizer', path=name)
    return dict(type=name)


def unescape(text: str) -> str:
    """A command-line string with Python escapes read (``'\\n\\n'`` ->
    two newlines); other characters, non-ASCII ones too, are kept
    (``unicode_escape`` alone reads its input as Latin-1 and garbles
    ``'。'``)."""
    return text.encode('ascii', 'backslashreplace').decode('unicode_escape')


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Tokenize local files into a token shard '
        '(docs/data.md).')
    parser.add_argument('output', help='the shard prefix to write')
    parser.add_argument('files', nargs='+',
                        help='text (.txt, .md), JSONL or Parquet files, '
                        'directories or globs; .xz-compressed text too')
    parser.add_argument('--tokenizer', default='bytes',
                        help='bytes (default), a registered tokenizer name '
                        '(ShakespeareBPE) or a local Hugging Face directory')
    parser.add_argument('--text-key', default='text',
                        help='the text field of JSONL / Parquet records')
    parser.add_argument('--separator', default=None,
                        help='split text files into documents here '
                        r"(escapes allowed: '\n\n'); default: one document "
                        'per file')
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> dict:
    """Write the shard; returns its header plus ``tokens_per_s``."""
    args = parse_args(argv)
    separator = None if args.separator is None else unescape(
        args.separator)
    tokenizer = build_tokenizer(tokenizer_cfg(args.tokenizer))
    start = time.perf_counter()
    header = write_documents(args.output, expand_files(args.files),
                             tokenizer, args.text_key, separator)
    seconds = time.perf_counter() - start
    if not header['num_tokens']:
        # (Training would refuse the shard later: "has 0 tokens".)
        for path in shard_files(args.output):
            path.unlink(missing_ok=True)
        raise SystemExit(f'prepare_data.py: error: {args.files} hold no '
                         'document with text; allowed: files with text, '
                         f'in JSONL records under "{args.text_key}"')
    header['tokens_per_s'] = round(header['num_tokens'] / max(seconds, 1e-9))
    print(json.dumps({k: v for k, v in header.items() if k != 'sources'},
                     indent=1))
    return header
