from mmpar.evaluation.accuracy import Accuracy
from mmpar.evaluation.language_model import LanguageModelMetric

__all__ = ['Accuracy', 'LanguageModelMetric']
