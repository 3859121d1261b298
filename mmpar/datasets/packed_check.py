"""The start-up check of ``document_attention`` against the model and the
layout (called by :func:`mmpar.config_check.check_layout`)."""
import inspect
from typing import Any, Optional

from mmpar.failures import ConfigError

LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')


def _forward_takes_doc_ids(cfg: Any) -> Optional[bool]:
    from mmpar.registry import MODELS
    model = cfg.get('model')
    if not isinstance(model, dict):
        return None
    cls = MODELS.get(model.get('type')) if isinstance(model.get('type'),
                                                       str) \
        else model.get('type')
    if not isinstance(cls, type):
        return None
    return 'doc_ids' in inspect.signature(cls.forward).parameters


def check_document_attention(cfg: Any, pp: Optional[int]) -> None:
    """A data set with ``document_attention=True`` needs a model whose
    ``forward`` takes ``doc_ids`` and no pipeline (a pipeline's stages are
    handed ``inputs`` alone, so the document ids could not reach the
    attention and the run would silently attend across documents).

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    for name in LOADERS:
        loader = cfg.get(name)
        dataset = loader.get('dataset') if isinstance(loader, dict) else None
        if not isinstance(dataset, dict) or \
                not dataset.get('document_attention'):
            continue
        key = f'{name}.dataset.document_attention'
        if pp is not None and pp > 1:
            raise ConfigError(
                f'{key}=True is not supported with parallel.pp={pp}: '
                'pipeline stages receive only the inputs, not doc_ids; '
                'allowed: document_attention=False (boundary targets stay '
                'masked) or parallel.pp=1')
        if _forward_takes_doc_ids(cfg) is False:
            raise ConfigError(
                f'{key}=True needs a model whose forward takes doc_ids; '
                f'model.type={cfg["model"].get("type")!r} does not; '
                'allowed: document_attention=False, or a model such as '
                'Llama')
