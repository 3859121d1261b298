"""Token batches for language-model parity tests."""
from typing import List

import torch


def make_token_batches(num: int = 4, batch_size: int = 4, seq_len: int = 16,
                       vocab_size: int = 64, seed: int = 1) -> List[dict]:
    """Global batches ``dict(inputs, data_samples)`` of token ids, the
    targets being the inputs shifted by one."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1),
                               generator=gen)
        batches.append(
            dict(inputs=tokens[:, :-1], data_samples=tokens[:, 1:]))
    return batches
