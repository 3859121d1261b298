"""Verify every shipped config at its documented layout (docs/verify.md).

    PYTHONPATH=$PWD python benchmarks/verify_shipped.py [--steps 2]
        [--only GLOB] [--documented] [--work-dir DIR] [--out TABLE.md]

For each file of ``configs/vit_digits``, ``configs/llama_shakespeare`` and
``configs/hf_finetune`` it runs, one config at a time,
``bash tools/dist_verify.sh CONFIG N --steps K`` at the world size the
config documents (its ``bash tools/dist_train.sh CONFIG N`` line; 2 when it
documents none; :data:`RANKS_HERE` where this CPU machine runs a smaller
documented layout, unless ``--documented``), with ``--cfg-options``
that shrink the model and the data (:func:`shrink_options`: the layout,
the plan and the wrapper stay the config's own). It prints a markdown
table (config, layout, ranks, verdict with the largest relative
difference) and writes it to ``--out``.

The Hugging Face fine-tuning configs load a local ``save_pretrained``
directory: a small random LlamaForCausalLM is written to
``WORK_DIR/hf_pretrained`` for them (offline).
"""
import argparse
import fnmatch
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DIRS = ('configs/vit_digits', 'configs/llama_shakespeare',
                'configs/hf_finetune')
DEFAULT_RANKS = 2
# Documented at 8 (pp=2 x tp=2 x dp_shard=2); its comment also documents
# 4 (pp=2 x tp=2, one data rank), the largest this machine runs.
RANKS_HERE = {'llama_shakespeare_pp_tp.py': 4}
_DOCUMENTED = re.compile(
    r'bash tools/dist_train\.sh\s+(?:\\\s*\n#\s*)?(\S+)\s+(\d+)')

VIT = {'model.embed_dim': 16, 'model.depth': 2, 'model.num_heads': 2,
       'train_dataloader.batch_size': 16}
# The small ViT has 2 blocks: a pipeline splits at the second.
VIT_PP = {'parallel.pipeline.split_points': ['blocks.1']}
LLAMA_DATA = {'train_dataloader.batch_size': 4,
              'train_dataloader.dataset.context_length': 32}
LLAMA = {'model.dim': 32, 'model.num_layers': 2, 'model.num_heads': 2,
         **LLAMA_DATA}
LLAMA_MOE = {'model.moe.hidden_dim': 32}
HF = {'model.config.hidden_size': 32, 'model.config.intermediate_size': 64,
      'model.config.num_hidden_layers': 2,
      'model.config.num_attention_heads': 2,
      'model.config.num_key_value_heads': 2, **LLAMA_DATA}
# The pretrained directory of the fine-tuning configs (bytes: 256 tokens).
HF_PRETRAINED = dict(vocab_size=256, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=False)


class Row(NamedTuple):
    """One table row."""
    config: str
    layout: str
    ranks: int
    verdict: str


def documented_ranks(path: Path, here: bool = True) -> int:
    """The world size ``path`` documents for itself (its own
    ``dist_train.sh`` line), :data:`RANKS_HERE` where set (unless
    ``here`` is False), else 2."""
    if here and path.name in RANKS_HERE:
        return RANKS_HERE[path.name]
    for name, ranks in _DOCUMENTED.findall(path.read_text()):
        if Path(name).name == path.name:
            return int(ranks)
    return DEFAULT_RANKS


def shrink_options(cfg) -> Dict[str, object]:
    """``--cfg-options`` that make ``cfg`` (an MMEngine Config) small
    enough for a 2-core CPU machine; the layout stays the config's."""
    model = cfg.model
    if model.get('type') in ('DigitsViT', 'SplittableViT'):
        opts = dict(VIT)
        if (cfg.get('parallel') or {}).get('pipeline'):
            opts.update(VIT_PP)
        return opts
    if model.get('type') == 'HFCausalLM':
        return dict(HF) if model.get('config') else dict(LLAMA_DATA)
    opts = dict(LLAMA)
    if model.get('moe'):
        opts.update(LLAMA_MOE)
    return opts


def layout_of(cfg, ranks: int) -> str:
    """The layout in words: the parallel axes at ``ranks`` and the
    wrapper."""
    from mmpar.verify.run import axes_line
    axes = axes_line(cfg, ranks).replace('layout ', '', 1)
    axes = axes.rsplit(' at ', 1)[0]
    from mmpar.wrappers.builder import DEFAULT_WRAPPER
    parallel = cfg.get('parallel') or {}
    wrapper = (cfg.get('model_wrapper_cfg') or {}).get('type')
    extra = [wrapper or f'{DEFAULT_WRAPPER} (default)']
    if isinstance(parallel.get('tp_plan'), str):
        extra.append(f"plan '{parallel['tp_plan']}'")
    elif parallel.get('tp_plan'):
        extra.append('own tp plan')
    pipeline = parallel.get('pipeline') or {}
    if pipeline.get('schedule'):
        extra.append(f"{pipeline['schedule']}, "
                     f"{pipeline.get('num_microbatches')} micro-batches")
    accumulate = cfg.optim_wrapper.get('accumulative_counts', 1)
    if accumulate > 1:
        extra.append(f'{accumulate} batches a step')
    return axes + (f" ({'; '.join(extra)})" if extra else '')


def verdict_of(stdout: str, returncode: int, steps: int,
               stderr: str = '') -> str:
    """The verdict cell from ``dist_verify.sh``'s output: ``agree (max
    relative difference)`` when all ``steps`` steps agree."""
    found = re.search(r'all (\d+) steps agree \(max relative difference '
                      r'([^;]+);', stdout)
    if found and returncode == 0 and int(found.group(1)) == steps:
        return f'agree ({found.group(2)})'
    for line in stdout.splitlines():
        if re.match(r'step \d+( differs first|: the layout failed)', line):
            return '**differs**: ' + line.strip()
    tail = [ln for ln in (stderr or stdout).splitlines() if ln.strip()]
    return f'**error** (exit {returncode}): ' + (tail[-1][:200] if tail
                                                  else 'no output')


def table(rows: List[Row], steps: int) -> str:
    """The markdown table of ``rows``."""
    lines = [f'| config | layout | ranks | verdict ({steps} steps, max '
             'relative difference) |', '|---|---|---|---|']
    for row in rows:
        verdict = row.verdict.replace('|', '\\|')
        lines.append(f'| `{row.config}` | {row.layout} | {row.ranks} | '
                     f'{verdict} |')
    return '\n'.join(lines)


def shipped_configs(only: Optional[str] = None) -> List[Path]:
    """Every shipped config (``--only``: those whose path matches)."""
    found = []
    for folder in SHIPPED_DIRS:
        for path in sorted((ROOT / folder).glob('*.py')):
            rel = str(path.relative_to(ROOT))
            if only is None or fnmatch.fnmatch(rel, only):
                found.append(path)
    return found


def _option_words(opts: Dict[str, object]) -> List[str]:
    words = []
    for key, value in opts.items():
        if isinstance(value, list):
            value = '[' + ','.join(f"'{v}'" for v in value) + ']'
        words.append(f'{key}={value}')
    return words


def make_pretrained(path: Path) -> Path:
    """A small random LlamaForCausalLM, ``save_pretrained`` (offline)."""
    if not (path / 'config.json').is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**HF_PRETRAINED)).save_pretrained(
            str(path))
    return path


def verify_one(path: Path, steps: int, work_dir: Path, timeout: int,
               here: bool = True) -> Row:
    """Run ``dist_verify.sh`` on one config (at :func:`documented_ranks`
    ``(path, here)``); its table row."""
    from mmengine.config import Config
    rel = str(path.relative_to(ROOT))
    cfg = Config.fromfile(str(path))
    ranks = documented_ranks(path, here)
    opts = shrink_options(cfg)
    if cfg.model.get('pretrained'):
        opts['model.pretrained'] = str(
            make_pretrained(work_dir / 'hf_pretrained'))
    cfg.merge_from_dict(opts)
    layout = layout_of(cfg, ranks)
    cmd = ['bash', 'tools/dist_verify.sh', rel, str(ranks), '--steps',
           str(steps), '--work-dir', str(work_dir / path.stem),
           '--cfg-options', *_option_words(opts)]
    print('$ ' + ' '.join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=str(ROOT) + os.pathsep +
               os.environ.get('PYTHONPATH', ''))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        verdict = verdict_of(proc.stdout, proc.returncode, steps,
                             proc.stderr)
        (work_dir / f'{path.stem}.log').write_text(proc.stdout +
                                                   proc.stderr)
    except subprocess.TimeoutExpired:
        verdict = f'**error**: no verdict within {timeout} s'
    print(f'  {verdict} ({time.perf_counter() - start:.0f} s)', flush=True)
    return Row(rel, layout, ranks, verdict)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=2)
    parser.add_argument('--only', help='glob on the config path')
    parser.add_argument('--work-dir', default='work_dirs/verify_shipped')
    parser.add_argument('--out', help='write the table here too')
    parser.add_argument('--timeout', type=int, default=900,
                        help='seconds per config')
    parser.add_argument('--documented', action='store_true',
                        help='the world size each config documents, also '
                        'where RANKS_HERE names a smaller one')
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work_dir = (ROOT / args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    rows = [verify_one(path, args.steps, work_dir, args.timeout,
                       here=not args.documented)
            for path in shipped_configs(args.only)]
    text = table(rows, args.steps)
    print(text)
    if args.out:
        Path(args.out).write_text(text + '\n')
    return 0 if all(r.verdict.startswith('agree') for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
