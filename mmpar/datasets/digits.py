"""The UCI 8x8 handwritten digits, shipped with mmpar (no download)."""
from pathlib import Path
from typing import Dict

import numpy as np
import torch
from torch.utils.data import Dataset

from mmpar.registry import DATASETS

DATA_FILE = Path(__file__).parent / 'data' / 'digits.npz'
SPLITS = ('train', 'val', 'all')


@DATASETS.register_module()
class DigitsDataset(Dataset):
    """1,797 8x8 grey images of the digits 0-9 (values 0..16).

    The split is fixed: every fifth sample (index % 5 == 0, 360 images) is
    validation, the other 1,437 are training.

    Args:
        split: ``'train'``, ``'val'`` or ``'all'``.
        data_file: an ``.npz`` with ``images`` (N, 8, 8) and ``labels`` (N,).

    Each item is ``dict(inputs=float tensor (1, 8, 8) in [0, 1],
    data_samples=int64 label)``, ready for ``default_collate``.
    """

    METAINFO = dict(classes=tuple(str(i) for i in range(10)))

    def __init__(self, split: str = 'train', data_file: str = str(DATA_FILE)):
        if split not in SPLITS:
            raise ValueError(f'split={split!r} is not supported; allowed: '
                             f'{", ".join(SPLITS)}')
        with np.load(data_file) as arrays:
            images, labels = arrays['images'], arrays['labels']
        index = np.arange(len(labels))
        if split != 'all':
            is_val = index % 5 == 0
            index = index[is_val] if split == 'val' else index[~is_val]
        self.split = split
        self.images = torch.from_numpy(images[index]).float().div_(16.0)
        self.labels = torch.from_numpy(labels[index]).long()

    @property
    def metainfo(self) -> dict:
        return dict(self.METAINFO)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return dict(
            inputs=self.images[idx].unsqueeze(0), data_samples=self.labels[idx])
