"""The token shard format (mmpar/datasets/token_shards.py): a round trip at
both dtypes, the checks on reading, the writer tool, and the tokenization
cache of text files."""
import json
import sys

import numpy as np
import pytest

from mmpar.datasets import ByteTokenizer
from mmpar.datasets.prepare import main as prepare_main
from mmpar.datasets.text_files import (expand_files, iter_documents,
                                       tokenize_files)
from mmpar.datasets.token_shards import (TokenShard, TokenShardWriter,
                                         read_header, shard_files,
                                         write_token_shard)


@pytest.mark.parametrize('vocab_size,dtype', [(300, 'uint16'),
                                              (70000, 'uint32')])
def test_round_trip_keeps_every_document(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, n).tolist()
            for n in (5, 0, 17, 1, 64)]
    prefix = tmp_path / 'shard'
    header = write_token_shard(prefix, docs, vocab_size, 'toy', ['a.txt'])
    assert header['dtype'] == dtype and header['num_documents'] == 5
    assert header['num_tokens'] == sum(map(len, docs))
    shard = TokenShard(prefix)
    # Memory-mapped, not loaded.
    assert isinstance(shard.tokens, np.memmap)
    assert isinstance(shard.offsets, np.memmap)
    assert [shard.document(i).tolist() for i in range(5)] == docs
    assert list(shard.starts_between(0, 100)) == [0, 5, 5, 22, 23]
    # The files are what docs/data.md says: raw little-endian arrays.
    bin_path, idx_path, _ = shard_files(prefix)
    raw = np.fromfile(bin_path, np.dtype(dtype).newbyteorder('<'))
    assert raw.tolist() == sum(docs, [])
    assert np.fromfile(idx_path, '<i8').tolist() == [0, 5, 5, 22, 23, 87]


def test_reading_refuses_incomplete_or_foreign_shards(tmp_path):
    prefix = tmp_path / 'shard'
    write_token_shard(prefix, [[1, 2, 3]], 10)
    bin_path, _, json_path = shard_files(prefix)
    with open(bin_path, 'ab') as f:
        f.write(b'\0\0')
    with pytest.raises(ValueError, match='has 8 bytes; its header says 6'):
        read_header(prefix)
    header = json.loads(json_path.read_text())
    json_path.write_text(json.dumps(dict(header, version=99)))
    with pytest.raises(ValueError, match='version 1'):
        read_header(prefix)
    json_path.unlink()
    with pytest.raises(FileNotFoundError, match='prepare_data'):
        TokenShard(prefix)
    with pytest.raises(ValueError, match='allowed: 0 .. 9'):
        write_token_shard(tmp_path / 'bad', [[3, 10]], 10)


def test_a_shard_appears_whole_or_not_at_all(tmp_path):
    """Written under temporary names and renamed on success: while a
    writer runs a reader sees the earlier shard (or none), and a failed
    write leaves the earlier shard and no temporary files. (Ranks that write
    the same shard at once raced here: one read the header another had
    just truncated.)"""
    prefix = tmp_path / 'shard'
    write_token_shard(prefix, [[1, 2, 3]], 10)
    with TokenShardWriter(prefix, 10) as writer:
        writer.add([4, 5])
        assert read_header(prefix)['num_tokens'] == 3
    assert read_header(prefix)['num_tokens'] == 2
    with pytest.raises(ValueError, match='allowed: 0 .. 9'):
        with TokenShardWriter(prefix, 10) as writer:
            writer.add([6, 7, 8, 9])
            writer.add([10])
    assert TokenShard(prefix).document(0).tolist() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        'shard.bin', 'shard.idx', 'shard.json']


def test_text_and_jsonl_documents(tmp_path):
    (tmp_path / 'a.txt').write_text('one\n\ntwo\n\n\n\nthree')
    (tmp_path / 'b.jsonl').write_text(
        '{"text": "x"}\n\n{"text": "yz", "id": 2}\n')
    files = expand_files([str(tmp_path)])
    assert [p.name for p in files] == ['a.txt', 'b.jsonl']
    assert list(iter_documents(files, separator='\n\n')) == [
        'one', 'two', 'three', 'x', 'yz']
    assert list(iter_documents(files[:1])) == ['one\n\ntwo\n\n\n\nthree']
    with pytest.raises(KeyError, match="text_key='body'"):
        list(iter_documents(files[1:], text_key='body'))
    with pytest.raises(FileNotFoundError, match='matches no file'):
        expand_files(str(tmp_path / '*.parquet'))



def test_parquet_documents(tmp_path, monkeypatch):
    import pyarrow as pa  # pinned in requirements-test.txt: never skipped
    import pyarrow.parquet as pq
    texts = ['one', 'two', 'three', 'four', 'five']
    pq.write_table(pa.table(dict(id=list(range(5)), body=texts)),
                   tmp_path / 'a.parquet', row_group_size=2)
    (tmp_path / 'b.jsonl').write_text('{"body": "six"}\n')
    files = expand_files([str(tmp_path)])
    assert [p.name for p in files] == ['a.parquet', 'b.jsonl']
    # Every row group, in order, then the next file.
    assert list(iter_documents(files, text_key='body')) == texts + ['six']
    shard = tokenize_files(str(tmp_path / '*.parquet'), ByteTokenizer(),
                           tmp_path / 'cache', text_key='body')
    assert TokenShard(shard).document(2).tolist() == list(b'three')
    with pytest.raises(KeyError, match=r"no text_key='text' column; its "
                       r"columns: \['body', 'id'\]"):
        list(iter_documents(files[:1]))
    monkeypatch.setitem(sys.modules, 'pyarrow.parquet', None)
    with pytest.raises(ImportError, match='reading Parquet needs pyarrow'):
        list(iter_documents(files[:1], text_key='body'))

def test_tokenization_is_cached(tmp_path, monkeypatch):
    (tmp_path / 'a.txt').write_text('hello\n\nworld')
    cache = tmp_path / 'cache'
    calls = []
    encode = ByteTokenizer.encode
    monkeypatch.setattr(ByteTokenizer, 'encode',
                        lambda self, t: calls.append(t) or encode(self, t))
    first = tokenize_files(str(tmp_path / 'a.txt'), ByteTokenizer(), cache,
                           separator='\n\n')
    assert calls == ['hello', 'world']
    # Second run: the shard is mapped, nothing is tokenized.
    assert tokenize_files(str(tmp_path / 'a.txt'), ByteTokenizer(), cache,
                          separator='\n\n') == first
    assert len(calls) == 2
    # Another reading of the same file is another shard.
    assert tokenize_files(str(tmp_path / 'a.txt'), ByteTokenizer(),
                          cache) != first
    assert TokenShard(first).document(1).tolist() == list(b'world')
    assert not list(cache.glob('*.tmp*'))


def test_prepare_data_writes_a_shard(tmp_path):
    (tmp_path / 'a.jsonl').write_text('{"body": "ab"}\n{"body": "c"}\n')
    header = prepare_main([str(tmp_path / 'out'), str(tmp_path / 'a.jsonl'),
                           '--text-key', 'body'])
    assert header['num_documents'] == 2 and header['tokenizer'] == 'bytes'
    assert header['tokens_per_s'] > 0
    assert TokenShard(tmp_path / 'out').document(0).tolist() == [97, 98]


def test_prepare_data_keeps_a_non_ascii_separator(tmp_path):
    text = tmp_path / 'sep.txt'
    text.write_text('Erster Absatz。Zweiter Absatz\n\nDritter。Vierter',
                    encoding='utf-8')
    header = prepare_main([str(tmp_path / 'cjk'), str(text),
                           '--separator', '。'])
    assert header['num_documents'] == 3
    shard = TokenShard(tmp_path / 'cjk')
    assert bytes(shard.document(1).tolist()).decode() == \
        'Zweiter Absatz\n\nDritter'
    # Escapes are still read: '\n\n' (backslash, n) splits at paragraphs.
    header = prepare_main([str(tmp_path / 'par'), str(text),
                           '--separator', r'\n\n'])
    assert header['num_documents'] == 2


def test_jsonl_strings_may_hold_raw_line_separators(tmp_path):
    # Valid JSON: U+2028, U+0085 and a lone '\r' raw inside strings
    # (json.dumps(ensure_ascii=False) writes them); lines end at '\n' only.
    texts = ['one\u2028two', 'three\x85four', 'five\rsix']
    path = tmp_path / 'ls.jsonl'
    path.write_bytes(''.join(
        json.dumps(dict(text=t), ensure_ascii=False) + '\r\n'
        for t in texts).encode('utf-8'))
    assert list(iter_documents([path])) == texts


@pytest.mark.parametrize('line,error,match', [
    ('{"text": "a", }', ValueError, r'docs\.jsonl:2: not a JSON record'),
    ('{"text": null}', TypeError, r"docs\.jsonl:2: text_key='text' holds "
     'None; allowed: a string'),
    ('{"text": 3}', TypeError, "holds 3"),
    ('"just a string"', KeyError, 'its keys: none: a str'),
], ids=['not json', 'null', 'a number', 'not a record'])
def test_a_bad_jsonl_record_is_named_by_file_and_line(tmp_path, line, error,
                                                      match):
    # A bare JSONDecodeError naming no file, or an AttributeError from deep
    # in the tokenizer ('NoneType' object has no attribute 'encode').
    path = tmp_path / 'docs.jsonl'
    path.write_text('{"text": "fine"}\n' + line + '\n')
    with pytest.raises(error, match=match):
        list(iter_documents(expand_files(str(path))))


def test_prepare_data_refuses_an_empty_corpus(tmp_path):
    # It wrote a shard of 0 tokens and exited 0; training refused it later.
    empty = tmp_path / 'empty.txt'
    empty.write_text('\n\n')
    with pytest.raises(SystemExit, match='hold no document with text'):
        prepare_main([str(tmp_path / 'shard'), str(empty)])
    assert not shard_files(tmp_path / 'shard')[0].exists()
