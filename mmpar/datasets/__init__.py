from mmpar.datasets.digits import DigitsDataset
from mmpar.datasets.shakespeare import ShakespeareDataset, load_text
from mmpar.datasets.tokenizer import ByteTokenizer

__all__ = ['DigitsDataset', 'ShakespeareDataset', 'ByteTokenizer', 'load_text']
