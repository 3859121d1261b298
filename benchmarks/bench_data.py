"""The data path against the training step, and its private memory.

    PYTHONPATH=$PWD python benchmarks/bench_data.py [--quick] [--shard-mib N]
        [--keep PREFIX]

1. Writes a token shard of ``--shard-mib`` MiB (uint16, documents of 50 to
   2,000 tokens; default 2,048 MiB) with ``mmpar.datasets.TokenShardWriter``.
2. In a fresh interpreter (a forked one's pages blur RSS): opens it as
   ``PackedTokenDataset(context_length=128, document_attention=True)`` and
   reads batches of 32 windows drawn at random over the whole shard
   through a ``DataLoader`` (``default_collate``, no workers): tokens per
   second read and packed, and the growth of the process's private memory
   (``RssAnon``; the pages of the map are file pages, ``RssFile``) after
   opening and after reading; apart, what MMEngine's ``InfiniteSampler``
   adds (its shuffle is a Python list of every index).
3. Times the training step of the shipped ``llama_corpus.py`` Llama (dim
   128, 4 blocks, batch 32 x 128, AdamW) on one process, one thread (as a
   torchrun rank, and as the reading process): tokens per second it
   consumes.

The goals (issue 35): the data path delivers >= 10x the step's tokens per
second, and reading a >= 2 GiB shard grows ``RssAnon`` by < 100 MiB.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mmpar.datasets.token_shards import read_header  # noqa: E402
MIB = 2**20


def write_shard(prefix: str, mib: int, seed: int = 0) -> dict:
    from mmpar.datasets.token_shards import TokenShardWriter
    rng = np.random.default_rng(seed)
    left = mib * MIB // 2
    with TokenShardWriter(prefix, 256, 'bytes') as writer:
        while left > 0:
            # A chunk of documents at a time: one array, cut by lengths.
            lengths = rng.integers(50, 2000, 512)
            tokens = rng.integers(0, 256, int(lengths.sum()), np.uint16)
            for doc in np.split(tokens, np.cumsum(lengths)[:-1]):
                doc = doc[:left]
                writer.add(doc)
                left -= len(doc)
                if left <= 0:
                    break
    return read_header(prefix)


def _rss_anon_kb() -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('RssAnon:'):
                return int(line.split()[1])
    raise KeyError('RssAnon')


def read_rate(prefix: str, batches: int) -> dict:
    """In this process: tokens/s read and packed, RssAnon growth."""
    import torch  # noqa: F401  (imported before the baseline is read)
    from mmengine.dataset import InfiniteSampler
    from torch.utils.data import DataLoader, default_collate

    from mmpar.datasets import PackedTokenDataset
    before = _rss_anon_kb()
    data = PackedTokenDataset([prefix], context_length=128,
                              document_attention=True)
    opened = _rss_anon_kb()
    # Windows drawn at random over the whole shard, without a permutation
    # of every index: the data path's own memory.
    rng = np.random.default_rng(0)
    draws = (int(i) for i in iter(lambda: rng.integers(len(data)), None))
    loader = iter(DataLoader(data, batch_size=32, collate_fn=default_collate,
                             sampler=draws))
    next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(loader)
    seconds = time.perf_counter() - start
    read = _rss_anon_kb()
    # MMEngine's InfiniteSampler shuffles with a Python list of every
    # index: its own cost, apart.
    indices = iter(InfiniteSampler(data, seed=0))
    next(indices)  # held while measured: freed, its list leaves no trace
    sampler_mib = (_rss_anon_kb() - read) / 1024
    tokens = batches * batch['inputs'].numel()
    return dict(windows=len(data), read_tokens_per_s=tokens / seconds,
                open_rss_anon_mib=(opened - before) / 1024,
                rss_anon_growth_mib=(read - before) / 1024,
                infinite_sampler_rss_anon_mib=sampler_mib)


def step_rate(steps: int) -> dict:
    """Tokens/s of the shipped Llama's training step (one process)."""
    import torch

    from mmpar.models import Llama
    torch.manual_seed(0)
    model = Llama(vocab_size=256, dim=128, num_layers=4, num_heads=4,
                  max_seq_len=128)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randint(0, 256, (32, 128))

    def step():
        loss = model(inputs, inputs, 'loss')['loss']
        loss.backward()
        optim.step()
        optim.zero_grad()

    # One thread, as each rank torchrun starts (OMP_NUM_THREADS=1) and as
    # the reading process.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return dict(step_tokens_per_s=steps * inputs.numel() / seconds)


def measure(shard_mib: int, batches: int, steps: int,
            keep: Optional[str] = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = keep or os.path.join(tmp, 'bench')
        start = time.perf_counter()
        try:  # --keep: a shard an earlier run wrote
            header, write_s = read_header(prefix), None
        except FileNotFoundError:
            header = write_shard(prefix, shard_mib)
            write_s = time.perf_counter() - start
        # A fresh interpreter: this one's pages would blur RSS.
        child = subprocess.run(
            [sys.executable, __file__, '--read', prefix, '--batches',
             str(batches)], capture_output=True, text=True, check=True,
            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1'))
        result = json.loads(child.stdout.splitlines()[-1])
    result.update(step_rate(steps))
    result.update(shard_mib=header['num_tokens'] * 2 / MIB,
                  shard_tokens=header['num_tokens'],
                  write_tokens_per_s=write_s and header['num_tokens'] /
                  write_s)
    result['data_over_step'] = (result['read_tokens_per_s'] /
                                result['step_tokens_per_s'])
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true',
                        help='a 16 MiB shard, a few batches and steps')
    parser.add_argument('--shard-mib', type=int, default=None)
    parser.add_argument('--keep', help='the shard prefix to write, and '
                        'to reuse when it exists')
    parser.add_argument('--read', help=argparse.SUPPRESS)
    parser.add_argument('--batches', type=int, default=None)
    args = parser.parse_args(argv)
    if args.read:
        print(json.dumps(read_rate(args.read, args.batches)))
        return {}
    shard_mib = args.shard_mib or (16 if args.quick else 2048)
    result = measure(shard_mib, args.batches or (20 if args.quick else 500),
                     3 if args.quick else 10, args.keep)
    print(json.dumps(result, indent=1))
    return result


if __name__ == '__main__':
    main()
