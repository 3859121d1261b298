from mmpar.models.vit import DigitsViT, TransformerBlock

__all__ = ['DigitsViT', 'TransformerBlock']
