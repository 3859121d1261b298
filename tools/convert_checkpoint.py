"""Convert a checkpoint: a sharded directory to one full file, or any mmpar
checkpoint to a Hugging Face directory.

    python tools/convert_checkpoint.py work_dirs/x/epoch_3 epoch_3.pth
    python tools/convert_checkpoint.py CKPT --to hf --config CONFIG --out DIR

Runs in one process with no process group. The full file is mmpar's ``full``
format: the plain model's keys, name-keyed optimizer state, schedulers, loop
state; it loads with ``torch.load(weights_only=True)``, into a plain model
with ``strict=True``, and resumes training under any wrapper or none. The
Hugging Face directory (config.json, safetensors, tokenizer files) loads with
``from_pretrained`` (``mmpar/convert.py``).
"""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.convert import main  # noqa: E402

if __name__ == '__main__':
    print(f'wrote {main()}')
