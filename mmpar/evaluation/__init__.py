from mmpar.evaluation.accuracy import Accuracy

__all__ = ['Accuracy']
