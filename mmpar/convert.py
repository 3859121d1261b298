"""What ``tools/convert_checkpoint.py`` runs: checkpoints to other formats.

    convert_checkpoint.py SRC DST                       sharded dir -> .pth
    convert_checkpoint.py CKPT --to hf --config CONFIG --out DIR

The second form writes a Hugging Face directory (config.json, safetensors
and, when the config's training data name a Hugging Face tokenizer, its
files) from any mmpar checkpoint of a model that meets the Hugging Face
weights protocol (``Llama``, ``HFCausalLM``): a full file or a sharded
directory, written by any layout. ``from_pretrained`` loads the result.
Both run in one process with no process group.
"""
import argparse
import os.path as osp
from typing import List, Optional

from mmpar.checkpoint import atomic_save, sharded_to_full
from mmpar.models.hf_weights import save_hf_checkpoint
from mmpar.cli import CfgOptionsAction
from mmpar.generation import load_model, tokenizer_from_config

FORMATS = ('full', 'hf')


def parse_convert_args(
        argv: Optional[List[str]] = None) -> argparse.Namespace:
    """``tools/convert_checkpoint.py``'s arguments, checked."""
    parser = argparse.ArgumentParser(
        description='Convert an mmpar checkpoint: a sharded directory to one '
        'full file (default), or any checkpoint to a Hugging Face directory '
        '(--to hf)')
    parser.add_argument(
        'src', help='checkpoint: a sharded directory (--to full) or any '
        'mmpar checkpoint (--to hf)')
    parser.add_argument('dst', nargs='?', help='output file (--to full)')
    parser.add_argument('--to', choices=FORMATS, default='full',
                        help='output format (default: full)')
    parser.add_argument('--config', help='the config that trained it '
                        '(--to hf: builds the model and names the tokenizer)')
    parser.add_argument('--out', help='output directory (--to hf)')
    parser.add_argument(
        '--cfg-options', nargs='+', action=CfgOptionsAction,
        help='override config keys, e.g. model.dim=64')
    args = parser.parse_args(argv)
    if args.to == 'full':
        if args.dst is None:
            parser.error('--to full needs DST, the output file (.pth)')
        if not osp.isdir(args.src):
            parser.error(
                f'src={args.src!r} is not a sharded checkpoint directory (a '
                'full checkpoint file needs no conversion)')
    else:
        if args.dst is not None:
            parser.error(f'--to hf writes --out DIR; remove DST={args.dst!r}')
        missing = [f'--{k}' for k in ('config', 'out')
                   if getattr(args, k) is None]
        if missing:
            parser.error(f'--to hf needs {" and ".join(missing)}')
    return args


def export_hf(checkpoint: str, config: str, out_dir: str,
              cfg_options: Optional[dict] = None) -> None:
    """Write ``checkpoint`` of ``config``'s model as a Hugging Face
    directory ``out_dir`` (with the config's tokenizer, if it names a
    Hugging Face one).

    Raises:
        FileNotFoundError: the config or checkpoint does not exist.
        ValueError: the model cannot be written as a Hugging Face model.
    """
    model = load_model(config, checkpoint, cfg_options)
    save_hf_checkpoint(model, model.state_dict(), out_dir)
    tokenizer = tokenizer_from_config(config, cfg_options)
    if hasattr(tokenizer, 'save_pretrained'):
        tokenizer.save_pretrained(out_dir)


def main(argv: Optional[List[str]] = None) -> str:
    """Parse ``argv`` and convert; returns what was written."""
    args = parse_convert_args(argv)
    if args.to == 'hf':
        export_hf(args.src, args.config, args.out, args.cfg_options)
        return args.out
    atomic_save(sharded_to_full(args.src), args.dst)
    return args.dst
