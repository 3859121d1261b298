"""How the shipped instruction set
``mmpar/datasets/data/shakespeare_sft_*.jsonl`` was made, from the shipped
Tiny Shakespeare (public domain).

Two kinds of record, alternating, from consecutive speeches ``SPEAKER:\\n
lines``: a chat (``messages``) where the user says the first line of a
speech and the assistant replies with the first line of the next speech,
in the role of its speaker (the system message names it); and an
instruction pair (``prompt`` / ``response``) asking who says a line,
answered with the speaker's name. Lines are kept short so that a record
fits the shipped Llama's 128 bytes. Deterministic: a test regenerates the
files and compares.

    python -m mmpar.datasets.shakespeare_sft    # rewrites the files
"""
import json
from pathlib import Path
from typing import Iterator, List, Tuple

from mmpar.datasets.shakespeare import load_text

SFT_DIR = Path(__file__).parent / 'data'
# Records of each file; 1,000 together.
SFT_SPLITS = dict(train=900, val=100)
MAX_LINE = 36


def _speeches(text: str) -> Iterator[Tuple[str, str]]:
    """``(speaker, first line)`` of each speech."""
    for block in text.split('\n\n'):
        lines = block.strip().split('\n')
        if len(lines) >= 2 and lines[0].endswith(':'):
            yield lines[0][:-1], lines[1].strip()


def shakespeare_sft_records(count: int = sum(SFT_SPLITS.values())
                            ) -> List[dict]:
    """The first ``count`` records (see the module docstring)."""
    speeches = list(_speeches(load_text()))
    records = []
    for (speaker, line), (replier, reply) in zip(speeches, speeches[1:]):
        if len(records) == count:
            break
        if not (len(line) <= MAX_LINE and len(reply) <= MAX_LINE
                and len(replier) <= 20 and speaker != replier):
            continue
        if len(records) % 2:
            records.append(dict(prompt=f'Who says "{reply}"?',
                                response=replier))
        else:
            records.append(dict(messages=[
                dict(role='system', content=f'You are {replier}.'),
                dict(role='user', content=line),
                dict(role='assistant', content=reply)]))
    return records


def sft_file_texts() -> dict:
    """Split name -> the JSONL text of its shipped file."""
    records, texts, start = shakespeare_sft_records(), {}, 0
    for split, count in SFT_SPLITS.items():
        texts[split] = ''.join(json.dumps(r) + '\n'
                               for r in records[start:start + count])
        start += count
    return texts


if __name__ == '__main__':
    for split, text in sft_file_texts().items():
        (SFT_DIR / f'shakespeare_sft_{split}.jsonl').write_text(text)
