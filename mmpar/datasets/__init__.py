from mmpar.datasets.digits import DigitsDataset
from mmpar.datasets.packed import PackedTokenDataset
from mmpar.datasets.sft import SFTDataset
from mmpar.datasets.shakespeare import ShakespeareDataset, load_text
from mmpar.datasets.token_shards import TokenShard, write_token_shard
from mmpar.datasets.tokenizer import (ByteTokenizer, HFTokenizer,
                                      build_tokenizer)

__all__ = [
    'DigitsDataset', 'ShakespeareDataset', 'ByteTokenizer', 'HFTokenizer',
    'build_tokenizer', 'load_text', 'PackedTokenDataset', 'TokenShard',
    'write_token_shard', 'SFTDataset'
]
