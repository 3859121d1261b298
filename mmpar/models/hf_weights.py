"""Hugging Face weights in and out: ``save_pretrained`` directories and
``.safetensors`` files, read one tensor at a time.

A model that can take such weights says so with two attributes (the
*Hugging Face weights protocol*; :class:`mmpar.models.Llama` and
:class:`mmpar.models.HFCausalLM` meet it):

- ``hf_config``: the ``transformers`` config of the equivalent Hugging Face
  model (its names, shapes and tied weights come from a meta-device build of
  it, so nothing is allocated);
- ``hf_to_plain_name(hf_name)``: the plain model's state-dict key of a
  Hugging Face key.

Reading never holds more than one tensor per call of
:func:`iter_hf_tensors` (``safetensors.safe_open``), and names come back as
the plain model's: the same function serves a loader that copies each tensor
straight into its shard. Nothing is downloaded: every path is local.
A mixture-of-experts directory (Mixtral, Qwen3-MoE: one tensor per expert
in the files, stacked in the model) is read whole through transformers'
``from_pretrained``, whose per-model conversion stacks the experts.
"""
import json
import os.path as osp
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
from torch import nn

from mmpar.models.hf_moe import hf_experts_modules
from mmpar.wrappers.base import describe

WEIGHTS_NAME = 'model.safetensors'
INDEX_NAME = 'model.safetensors.index.json'
CONFIG_NAME = 'config.json'
# Config keys that change what the weights compute without changing any
# shape: a mismatch would load silently and give other logits.
# Heads too: 2 heads of 16 and 4 of 8 have the same weight shapes.
ARCHITECTURE_KEYS = ('model_type', 'hidden_act', 'rms_norm_eps',
                     'rope_parameters', 'rope_scaling', 'attention_bias',
                     'mlp_bias', 'tie_word_embeddings', 'num_attention_heads',
                     'num_key_value_heads', 'head_dim')


def is_hf_checkpoint(path: str) -> bool:
    """A ``.safetensors`` file, or a directory holding ``model.safetensors``
    or its sharded index (what ``save_pretrained`` writes)."""
    if path.endswith('.safetensors'):
        return True
    return osp.isdir(path) and (osp.isfile(osp.join(path, WEIGHTS_NAME)) or
                                osp.isfile(osp.join(path, INDEX_NAME)))


def hf_weight_files(path: str) -> Dict[str, str]:
    """Hugging Face key -> the file that holds it.

    Args:
        path: a ``.safetensors`` file or a ``save_pretrained`` directory
            (single file, or sharded with ``model.safetensors.index.json``).

    Raises:
        FileNotFoundError: ``path``, or a file the index names, is missing.
    """
    from safetensors import safe_open
    if not osp.exists(path):
        raise FileNotFoundError(f'Hugging Face weights {path!r} do not exist')
    if osp.isdir(path) and osp.isfile(osp.join(path, INDEX_NAME)):
        index_file = osp.join(path, INDEX_NAME)
        with open(index_file) as file:
            weight_map = json.load(file)['weight_map']
        files = {k: osp.join(path, f) for k, f in weight_map.items()}
        for name in sorted(set(files.values())):
            if not osp.isfile(name):
                raise FileNotFoundError(
                    f'{index_file} names {osp.basename(name)!r}, which does '
                    'not exist')
        return files
    if osp.isdir(path):
        path = osp.join(path, WEIGHTS_NAME)
    if not osp.isfile(path):
        raise FileNotFoundError(
            f'Hugging Face weights {path!r} do not exist (allowed: a '
            f'.safetensors file, or a directory with {WEIGHTS_NAME} or '
            f'{INDEX_NAME})')
    with safe_open(path, framework='pt') as file:
        return {key: path for key in file.keys()}


SAFETENSORS_DTYPES = {
    'F64': torch.float64, 'F32': torch.float32, 'F16': torch.float16,
    'BF16': torch.bfloat16, 'I64': torch.int64, 'I32': torch.int32,
    'I16': torch.int16, 'I8': torch.int8, 'U8': torch.uint8,
    'BOOL': torch.bool,
}


def mapped_tensors(filename: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file, memory-mapped: nothing is
    read until used, and a rank that takes only its shard of a tensor reads
    only those pages (copy-on-write: the file is never changed)."""
    import mmap
    with open(filename, 'rb') as file:
        size = int.from_bytes(file.read(8), 'little')
        header = json.loads(file.read(size))
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + size
    tensors = {}
    for key, info in header.items():
        if key == '__metadata__':
            continue
        dtype = SAFETENSORS_DTYPES[info['dtype']]
        begin, end = info['data_offsets']
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(mapped, dtype=dtype, count=count,
                                offset=start + begin) if count else \
            torch.empty(0, dtype=dtype)
        tensors[key] = flat.reshape(info['shape'])
    return tensors


def iter_hf_tensors(
        files: Dict[str, str],
        names: Optional[Iterable[str]] = None
) -> Iterator[Tuple[str, str, torch.Tensor]]:
    """``(hf_name, file, tensor)`` for ``names`` (default: every key of
    ``files``, as :func:`hf_weight_files` gives them), memory-mapped
    (:func:`mapped_tensors`): each file is mapped once, no tensor is read
    until used."""
    wanted = list(files) if names is None else list(names)
    by_file: Dict[str, list] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for filename, keys in by_file.items():
        mapped = mapped_tensors(filename)
        for key in keys:
            yield key, filename, mapped[key]


def hf_owner(model: nn.Module) -> nn.Module:
    """The user's model inside ``model`` (any wrapper; for a pipeline this
    rank's stage copy), if it meets the Hugging Face weights protocol.

    Raises:
        ValueError: the model does not declare ``hf_to_plain_name``.
    """
    plain = describe(model).model
    if callable(getattr(plain, 'hf_to_plain_name', None)):
        return plain
    raise ValueError(
        f'{type(model).__name__} cannot take Hugging Face weights; allowed: '
        'a model with hf_config and hf_to_plain_name (Llama, HFCausalLM)')


def meta_hf_model(hf_config) -> nn.Module:
    """The Hugging Face model of ``hf_config`` on the meta device (names,
    shapes and tied weights; no memory)."""
    from transformers import AutoModelForCausalLM
    with torch.device('meta'):
        return AutoModelForCausalLM.from_config(hf_config)


def tied_sources(hf_model: nn.Module) -> Dict[str, str]:
    """Each tied key -> the first key of the same parameter (a tied copy
    that ``save_pretrained`` leaves out of the file)."""
    first: Dict[int, str] = {}
    tied = {}
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _check_architecture(path: str, hf_config) -> None:
    config_file = osp.join(path if osp.isdir(path) else osp.dirname(path),
                           CONFIG_NAME)
    if not osp.isfile(config_file):
        return
    with open(config_file) as file:
        saved = json.load(file)
    ours = hf_config.to_dict()
    for key in ARCHITECTURE_KEYS:
        if key in saved and key in ours and saved[key] != ours[key]:
            raise ValueError(
                f'{config_file}: {key}={saved[key]!r}, but the model is '
                f'configured with {key}={ours[key]!r}; set the model config '
                'to match the checkpoint')


def read_hf_state_dict(path: str, model: nn.Module) -> Dict[str, torch.Tensor]:
    """Hugging Face weights as the plain state dict of ``model``.

    Args:
        path: a ``.safetensors`` file or a ``save_pretrained`` directory.
        model: the model to load into, plain or wrapped (its plain model
            meets the Hugging Face weights protocol).

    Returns:
        Every key of the plain model's state dict (tied copies included),
        each tensor in the dtype the model's parameters have.

    Raises:
        FileNotFoundError: ``path`` or a file its index names is missing.
        ValueError: a key the model needs is missing, a key is unknown, a
            shape differs, or ``config.json`` gives another architecture;
            the message names the file and the key.
    """
    owner = hf_owner(model)
    files = hf_weight_files(path)
    _check_architecture(path, owner.hf_config)
    reference = meta_hf_model(owner.hf_config)
    expected = reference.state_dict()
    if hf_experts_modules(reference):
        return _read_through_transformers(path, owner, expected)
    tied = tied_sources(reference)
    unknown = sorted(set(files) - set(expected))
    if unknown:
        raise ValueError(
            f'{path}: keys {unknown[:5]} are not weights of a '
            f'{type(reference).__name__} with this config')
    sources = {}
    for key in expected:
        source = key if key in files else tied.get(key)
        if source not in files:
            raise ValueError(f'{path}: key {key!r} is missing (the model '
                             f'{type(owner).__name__} needs it)')
        sources[key] = source
    tensors = {}
    # In model order (a set would make the first error reported random).
    for key, filename, tensor in iter_hf_tensors(
            files, dict.fromkeys(sources.values())):
        want = expected[key]
        if tensor.shape != want.shape:
            raise ValueError(
                f'{filename}: key {key!r} has shape {tuple(tensor.shape)}, '
                f'the model needs {tuple(want.shape)}')
        tensors[key] = tensor.to(want.dtype)
    return {owner.hf_to_plain_name(key): tensors[source]
            for key, source in sources.items()}


def _read_through_transformers(path: str, owner: nn.Module,
                               expected: Dict[str, torch.Tensor]
                               ) -> Dict[str, torch.Tensor]:
    # save_pretrained writes MoE experts one tensor per expert (the
    # checkpoints' layout, e.g. Mixtral's block_sparse_moe.experts.<e>.w1)
    # and from_pretrained stacks them into the model's gate_up_proj /
    # down_proj by its per-model conversion table: let it (the whole model
    # in memory on each rank, not one tensor at a time).
    from transformers import AutoModelForCausalLM
    if not osp.isdir(path):
        raise ValueError(
            f'{path}: the experts of {type(owner).__name__} are read through '
            "transformers' from_pretrained; allowed: a save_pretrained "
            'directory')
    hf_model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, config=owner.hf_config)
    state = hf_model.state_dict()
    return {owner.hf_to_plain_name(key): state[key].to(want.dtype)
            for key, want in expected.items()}


def save_hf_checkpoint(model: nn.Module, state: Dict[str, torch.Tensor],
                       out_dir: str) -> None:
    """Write ``state`` (the plain model's full state dict) as the Hugging
    Face model of ``model``'s ``hf_config``: ``out_dir`` gets config.json,
    generation_config.json and ``model.safetensors`` (sharded with an index
    past 50 GB), as ``save_pretrained`` writes them.

    Raises:
        ValueError: ``state`` lacks a key the Hugging Face model needs.
    """
    owner = hf_owner(model)
    hf_model = meta_hf_model(owner.hf_config)
    tied = tied_sources(hf_model)
    weights = {}
    for key in hf_model.state_dict():
        if key in tied:
            continue
        plain = owner.hf_to_plain_name(key)
        if plain not in state:
            raise ValueError(f'checkpoint has no {plain!r} (Hugging Face '
                             f'{key!r}) for {type(owner).__name__}')
        weights[key] = state[plain].detach().cpu().contiguous()
    # The meta model takes the tensors themselves (no copy); buffers that
    # are not saved (rotary tables) stay on the meta device, and
    # from_pretrained rebuilds them.
    hf_model.load_state_dict(weights, strict=False, assign=True)
    hf_model.tie_weights()
    hf_model.save_pretrained(out_dir)
