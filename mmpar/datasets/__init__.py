from mmpar.datasets.digits import DigitsDataset

__all__ = ['DigitsDataset']
