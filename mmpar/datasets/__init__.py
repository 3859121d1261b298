from mmpar.datasets.digits import DigitsDataset
from mmpar.datasets.shakespeare import ShakespeareDataset, load_text
from mmpar.datasets.tokenizer import (ByteTokenizer, HFTokenizer,
                                      build_tokenizer)

__all__ = [
    'DigitsDataset', 'ShakespeareDataset', 'ByteTokenizer', 'HFTokenizer',
    'build_tokenizer', 'load_text'
]
