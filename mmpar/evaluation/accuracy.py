"""Top-1 accuracy over predictions ``dict(pred_label, gt_label)``."""
from typing import List, Sequence

from mmengine.evaluator import BaseMetric

from mmpar.registry import METRICS


@METRICS.register_module()
class Accuracy(BaseMetric):
    """Top-1 accuracy in percent, reported as ``accuracy/top1``.

    Args:
        collect_device: ``'gpu'`` (default) gathers results with
            ``all_gather_object``, which runs on gloo too and needs no shared
            filesystem; ``'cpu'`` writes temporary files under ``./.dist_test``.
        prefix: metric-name prefix.
    """

    default_prefix = 'accuracy'

    def __init__(self, collect_device: str = 'gpu', prefix: str = None):
        super().__init__(collect_device=collect_device, prefix=prefix)

    def process(self, data_batch, data_samples: Sequence[dict]) -> None:
        for sample in data_samples:
            self.results.append(
                int(sample['pred_label']) == int(sample['gt_label']))

    def compute_metrics(self, results: List[bool]) -> dict:
        return dict(top1=100.0 * sum(results) / max(len(results), 1))
