"""The start-up check of ``document_attention`` against the model and the
layout (called by :func:`mmpar.config_check.check_layout`)."""
import inspect
from typing import Any, Optional

from mmpar.failures import ConfigError

LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')


def _model_class(cfg: Any) -> Optional[type]:
    from mmpar.registry import MODELS
    model = cfg.get('model')
    if not isinstance(model, dict):
        return None
    cls = MODELS.get(model.get('type')) if isinstance(model.get('type'),
                                                       str) \
        else model.get('type')
    return cls if isinstance(cls, type) else None


def check_document_attention(cfg: Any, pp: Optional[int]) -> None:
    """A data set with ``document_attention=True`` needs a model whose
    ``forward`` takes ``doc_ids`` and, under a pipeline, whose pipeline
    protocol hands them to every stage (``pipeline_kwargs`` names
    ``doc_ids``): otherwise the document ids could not reach the attention
    and the run would silently attend across documents.

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    cls = _model_class(cfg)
    for name in LOADERS:
        loader = cfg.get(name)
        dataset = loader.get('dataset') if isinstance(loader, dict) else None
        if not isinstance(dataset, dict) or \
                not dataset.get('document_attention'):
            continue
        key = f'{name}.dataset.document_attention'
        model = cfg.get('model')
        model_type = model.get('type') if isinstance(model, dict) else None
        if cls is not None and \
                'doc_ids' not in inspect.signature(cls.forward).parameters:
            raise ConfigError(
                f'{key}=True needs a model whose forward takes doc_ids; '
                f'model.type={model_type!r} does not; allowed: '
                'document_attention=False, or a model such as Llama')
        # A model that cannot be looked up here is refused under a pipeline:
        # nothing shows that its stages get the document ids.
        if pp is not None and pp > 1 and (
                cls is None
                or 'doc_ids' not in getattr(cls, 'pipeline_kwargs', ())):
            raise ConfigError(
                f'{key}=True is not supported with parallel.pp={pp} for '
                f'model.type={model_type!r}: its pipeline protocol does not '
                "hand doc_ids to every stage (pipeline_kwargs = ('doc_ids', "
                '), docs/pipeline_parallel.md); allowed: '
                'document_attention=False (boundary targets stay masked), '
                'parallel.pp=1, or a model such as Llama')
