"""Documents from local text, JSONL and Parquet files, tokenized once.

:func:`iter_documents` reads files as documents; :func:`tokenize_files`
writes them as a token shard (:mod:`mmpar.datasets.token_shards`) under a
cache key made of the files (path, size, modification time), the tokenizer
and the reading options, so a second run (or every other rank) maps the
shard instead of tokenizing again. ``tools/prepare_data.py`` calls the same
function with an output prefix of your choosing.
"""
import glob
import hashlib
import json
import lzma
import os
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

from mmpar.datasets.token_shards import (VERSION, read_header,
                                         write_token_shard)
from mmpar.datasets.tokenizer import Tokenizer

TEXT_SUFFIXES = ('.txt', '.md', '.text')
JSONL_SUFFIXES = ('.jsonl', '.ndjson')
PARQUET_SUFFIXES = ('.parquet', )
# A path starting with this names a file shipped in mmpar/datasets/data.
PACKAGE_DATA = 'mmpar:'
PACKAGE_DATA_DIR = Path(__file__).parent / 'data'


def _kind(path: Path) -> str:
    suffixes = path.suffixes[-2:] if path.suffix == '.xz' else [path.suffix]
    suffix = suffixes[0] if suffixes else ''
    for kind, known in (('text', TEXT_SUFFIXES), ('jsonl', JSONL_SUFFIXES),
                        ('parquet', PARQUET_SUFFIXES)):
        if suffix in known:
            return kind
    raise ValueError(
        f'{path}: suffix {"".join(suffixes)!r} is not supported; allowed: '
        f'{", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)} '
        '(text and JSONL also .xz-compressed)')


def expand_files(files: Union[str, Sequence[str]]) -> List[Path]:
    """Files from paths, globs and directories (searched recursively for
    supported suffixes), sorted, each once; ``mmpar:NAME`` is a file shipped
    in ``mmpar/datasets/data``.

    Raises:
        FileNotFoundError: a pattern that matches nothing.
    """
    found = []
    for pattern in [files] if isinstance(files, str) else files:
        pattern = str(pattern)
        if pattern.startswith(PACKAGE_DATA):
            pattern = str(PACKAGE_DATA_DIR / pattern[len(PACKAGE_DATA):])
        matches = sorted(glob.glob(os.path.expanduser(pattern),
                                   recursive=True))
        if not matches:
            raise FileNotFoundError(f'files={pattern!r} matches no file')
        for match in map(Path, matches):
            if match.is_dir():
                found += sorted(p for p in match.rglob('*')
                                if p.is_file() and _supported(p))
            else:
                found.append(match)
    return list(dict.fromkeys(p.resolve() for p in found))


def _supported(path: Path) -> bool:
    try:
        return bool(_kind(path))
    except ValueError:
        return False


def read_text(path: Path) -> str:
    """A UTF-8 text file, ``.xz``-compressed or plain."""
    raw = path.read_bytes()
    if path.suffix == '.xz':
        raw = lzma.decompress(raw)
    return raw.decode('utf-8')


def jsonl_records(path: Path) -> Iterator[Tuple[str, Any]]:
    """``(where, record)`` of a JSONL file: ``where`` is ``'PATH:LINE'``.

    Raises:
        ValueError: a line that is not JSON, naming the file and line.
    """
    for number, line in jsonl_lines(path):
        where = f'{path}:{number}'
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f'{where}: not a JSON record ({err.msg} at '
                             f'column {err.colno}); allowed: one JSON '
                             'object per line') from None


def jsonl_lines(path: Path) -> Iterator[Tuple[int, str]]:
    """``(line number, line)`` of a JSONL file's non-blank lines, split at
    ``'\\n'`` only (a trailing ``'\\r'`` dropped): ``str.splitlines``
    would also split at U+2028, U+0085 and other characters that a JSON
    string may hold raw (``json.dumps(ensure_ascii=False)`` writes them)."""
    for number, line in enumerate(read_text(path).split('\n'), 1):
        line = line[:-1] if line.endswith('\r') else line
        if line.strip():
            yield number, line


def iter_documents(files: Sequence[Path], text_key: str = 'text',
                   separator: Optional[str] = None) -> Iterator[str]:
    """The documents of ``files``, in order.

    Args:
        files: from :func:`expand_files`.
        text_key: the field holding the text in JSONL and Parquet records.
        separator: split a text file into documents at this string (e.g.
            ``'\\n\\n'``: paragraphs); ``None``: a text file is one
            document. Empty documents are skipped.

    Raises:
        KeyError: a record (or a Parquet file) without ``text_key``.
        ImportError: a Parquet file without pyarrow installed.
    """
    for path in files:
        kind = _kind(path)
        if kind == 'text':
            text = read_text(path)
            parts = [text] if separator is None else text.split(separator)
            yield from (p for p in parts if p.strip())
        elif kind == 'jsonl':
            for where, record in jsonl_records(path):
                yield _field(record, text_key, where)
        else:
            for row, text in enumerate(_parquet_texts(path, text_key)):
                yield _text(text, text_key, f'{path} row {row}')


def record_keys(record: Any) -> str:
    """A JSONL record's keys for a message (a line may hold a non-dict)."""
    return str(sorted(record)) if isinstance(record, dict) else \
        f'none: a {type(record).__name__}'


def _field(record: Any, key: str, where: str) -> str:
    if not isinstance(record, dict) or key not in record:
        raise KeyError(f'{where}: record has no text_key={key!r}; its keys: '
                       f'{record_keys(record)}')
    return _text(record[key], key, where)


def _text(value: Any, key: str, where: str) -> str:
    """A record's text: a string (a null or a number would be tokenized as
    its repr, or fail deep in the tokenizer)."""
    if not isinstance(value, str):
        raise TypeError(f'{where}: text_key={key!r} holds {value!r}; '
                        'allowed: a string')
    return value


def _parquet_texts(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f'{path}: reading Parquet needs pyarrow, which is not installed '
            '(mmpar does not depend on it); pip install pyarrow, or convert '
            'the file to JSONL') from None
    parquet = pq.ParquetFile(path)
    columns = parquet.schema_arrow.names
    if text_key not in columns:
        raise KeyError(f'{path}: Parquet file has no text_key={text_key!r} '
                       f'column; its columns: {sorted(columns)}')
    for batch in parquet.iter_batches(columns=[text_key]):
        yield from batch.column(0).to_pylist()


def cache_key(files: Sequence[Path], tokenizer: Tokenizer,
              **options) -> str:
    """A digest of what a tokenized shard depends on."""
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    described = json.dumps(
        dict(version=VERSION, files=stats, tokenizer=tokenizer.name,
             tokenizer_digest=getattr(tokenizer, 'digest', ''),
             vocab_size=tokenizer.vocab_size, options=options),
        sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    """``$MMPAR_CACHE/tokens``, else ``~/.cache/mmpar/tokens``."""
    root = os.environ.get('MMPAR_CACHE') or os.path.join(
        os.path.expanduser('~'), '.cache', 'mmpar')
    return Path(root) / 'tokens'


def write_documents(prefix: Union[str, Path], files: Sequence[Path],
                    tokenizer: Tokenizer, text_key: str = 'text',
                    separator: Optional[str] = None) -> dict:
    """Tokenize the documents of ``files`` into the shard ``prefix``
    (:class:`~mmpar.datasets.token_shards.TokenShardWriter` renames it into
    place whole: ranks writing
    the same shard at once write the same bytes).

    Returns:
        The shard's header.
    """
    return write_token_shard(
        prefix, map(tokenizer.encode,
                    iter_documents(files, text_key, separator)),
        tokenizer.vocab_size, tokenizer.name, [str(p) for p in files],
        getattr(tokenizer, 'digest', ''))


def tokenize_files(files: Union[str, Sequence[str]], tokenizer: Tokenizer,
                   cache_dir: Optional[str] = None, text_key: str = 'text',
                   separator: Optional[str] = None) -> str:
    """The prefix of a cached shard of ``files`` tokenized by
    ``tokenizer``; tokenized now unless the cache has it.

    Args:
        files: paths, globs or directories (:func:`expand_files`).
        tokenizer: a built tokenizer.
        cache_dir: where shards are kept (``None``:
            :func:`default_cache_dir`).
        text_key: the text field of JSONL / Parquet records.
        separator: where a text file splits into documents.
    """
    paths = expand_files(files)
    key = cache_key(paths, tokenizer, text_key=text_key,
                    separator=separator)
    prefix = Path(cache_dir or default_cache_dir()) / key
    try:
        read_header(prefix)
    except FileNotFoundError:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_documents(prefix, paths, tokenizer, text_key, separator)
    return str(prefix)
