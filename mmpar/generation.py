"""Text from a trained language model: what ``tools/generate.py`` runs.

The model is built from the config *unwrapped*, in one process, and takes the
weights of a full checkpoint file, a sharded (DCP) checkpoint directory
(whatever layout wrote them) or Hugging Face weights. Text is encoded and
decoded with the tokenizer the config's training data use. Sampling draws
from a seeded generator, so the same seed prints the same text.
"""
import argparse
import os.path as osp
from typing import List, Optional

import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from torch import nn

from mmpar.cli import CfgOptionsAction
from mmpar.datasets.tokenizer import Tokenizer, build_tokenizer


def load_state_dict(checkpoint: str) -> dict:
    """The model weights of a full checkpoint file or a sharded directory,
    with the plain model's keys."""
    from mmpar.checkpoint import (is_sharded_checkpoint,
                                  load_checkpoint_file, sharded_to_full)
    if is_sharded_checkpoint(checkpoint):
        state = sharded_to_full(checkpoint)
    else:
        state = load_checkpoint_file(checkpoint)
    return state.get('state_dict', state)


def _config(config: str, cfg_options: Optional[dict]) -> Config:
    if not osp.isfile(config):
        raise FileNotFoundError(f'config file {config!r} does not exist')
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    init_default_scope(cfg.get('default_scope', 'mmpar'))
    return cfg


def load_model(config: str, checkpoint: Optional[str] = None,
               cfg_options: Optional[dict] = None) -> nn.Module:
    """Build ``config``'s model (no wrapper) and load ``checkpoint`` (an
    mmpar checkpoint or Hugging Face weights) into it with ``strict=True``;
    in eval mode.

    Raises:
        FileNotFoundError: the config or checkpoint does not exist.
    """
    from mmpar.checkpoint import is_hf_checkpoint, read_hf_state_dict
    from mmpar.registry import MODELS
    model = MODELS.build(_config(config, cfg_options).model)
    if checkpoint is not None:
        if not osp.exists(checkpoint):
            raise FileNotFoundError(
                f'checkpoint {checkpoint!r} does not exist')
        state = read_hf_state_dict(checkpoint, model) if is_hf_checkpoint(
            checkpoint) else load_state_dict(checkpoint)
        model.load_state_dict(state, strict=True)
    return model.eval()


def tokenizer_from_config(config: str,
                          cfg_options: Optional[dict] = None) -> Tokenizer:
    """The tokenizer of ``config``'s training data (bytes when it names
    none)."""
    cfg = _config(config, cfg_options)
    dataset = (cfg.get('train_dataloader') or {}).get('dataset') or {}
    return build_tokenizer(dataset.get('tokenizer'))


def _next_token(logits: torch.Tensor, temperature: float,
                top_k: Optional[int],
                generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(model: nn.Module,
             prompt_ids: List[int],
             max_new_tokens: int,
             temperature: float = 1.0,
             top_k: Optional[int] = None,
             seed: int = 0) -> List[int]:
    """Sample ``max_new_tokens`` tokens after ``prompt_ids``.

    Args:
        model: called as ``model(ids, mode='tensor')`` for logits
            ``(1, T, V)``; its ``max_seq_len`` (if any) crops the context.
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to add.
        temperature: softmax temperature; 0 picks the most likely token.
        top_k: sample among the ``top_k`` most likely tokens only.
        seed: seed of the sampling generator (same seed, same text).

    Returns:
        The new token ids (without the prompt).
    """
    if not prompt_ids:
        raise ValueError('prompt is empty; give at least one token')
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = getattr(model, 'max_seq_len', None)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        window = ids if context is None else ids[:, -context:]
        logits = model(window, mode='tensor')[:, -1].float()
        ids = torch.cat(
            [ids, _next_token(logits, temperature, top_k, generator)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def generate_text(model: nn.Module, prompt: str, max_new_tokens: int,
                  tokenizer: Optional[Tokenizer] = None, **kwargs) -> str:
    """The prompt followed by ``max_new_tokens`` sampled tokens, as text
    (``tokenizer``: bytes by default; keyword arguments as
    :func:`generate`)."""
    tokenizer = tokenizer or build_tokenizer(None)
    ids = tokenizer.encode(prompt)
    return tokenizer.decode(ids + generate(model, ids, max_new_tokens,
                                           **kwargs))


def parse_generate_args(
        argv: Optional[List[str]] = None) -> argparse.Namespace:
    """``tools/generate.py``'s arguments, checked."""
    parser = argparse.ArgumentParser(
        description='Print text sampled from a trained language model')
    parser.add_argument('config', help='config file')
    parser.add_argument(
        'checkpoint', help='checkpoint file, sharded checkpoint directory '
        'or Hugging Face weights (save_pretrained directory, .safetensors)')
    parser.add_argument('--prompt', default='ROMEO:', help='text to continue')
    parser.add_argument('--max-new-tokens', type=int, default=200)
    parser.add_argument(
        '--temperature', type=float, default=0.8,
        help='softmax temperature; 0 takes the most likely token')
    parser.add_argument('--top-k', type=int, default=None,
                        help='sample among the k most likely tokens')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument(
        '--cfg-options', nargs='+', action=CfgOptionsAction,
        help='override config keys, e.g. model.max_seq_len=256')
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        parser.error(f'--max-new-tokens={args.max_new_tokens} must be >= 0')
    if args.temperature < 0:
        parser.error(f'--temperature={args.temperature} must be >= 0')
    if args.top_k is not None and args.top_k < 1:
        parser.error(f'--top-k={args.top_k} must be >= 1')
    if not args.prompt:
        parser.error('--prompt is empty; give at least one character')
    return args


def main(argv: Optional[List[str]] = None) -> str:
    """Parse ``argv``, load the model, return the generated text."""
    args = parse_generate_args(argv)
    model = load_model(args.config, args.checkpoint, args.cfg_options)
    return generate_text(
        model, args.prompt, args.max_new_tokens,
        tokenizer=tokenizer_from_config(args.config, args.cfg_options),
        temperature=args.temperature, top_k=args.top_k, seed=args.seed)
