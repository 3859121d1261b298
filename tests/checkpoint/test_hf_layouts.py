"""Hugging Face weights in and out of every layout, checked by logits.

A small ``LlamaForCausalLM`` is made offline (``from_config`` +
``save_pretrained``). Under one process, DDP, FSDP2, tp=2, pp=2 and
pp=2 x tp=2 it is loaded into ``HFCausalLM(pretrained=DIR)`` and into
mmpar's ``Llama`` through ``Runner.load_checkpoint`` (what ``load_from``
runs): the logits on a fixed batch equal Hugging Face's own forward. After
three training steps the model is exported (``save_hf_checkpoint``, what
``convert_checkpoint.py --to hf`` runs) and reloaded with
``from_pretrained``: its logits equal the ones mmpar computes in that
layout. fp32 throughout, max abs diff <= 1e-5.
"""
import copy
import types

import pytest
import torch
import torch.distributed as dist

from tests.lm_toy import make_token_batches
from tests.toy import make_optim_wrapper

HF_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
# The same architecture as mmpar's Llama.
LLAMA = dict(type='Llama', vocab_size=64, dim=32, num_layers=2, num_heads=4,
             num_kv_heads=2, hidden_dim=64, max_seq_len=16)
ATOL = 1e-5
LAYOUTS = {
    'ddp': (2, None, dict(type='MMDistributedDataParallel')),
    'fsdp2': (2, None, dict(type='MMFullyShard')),
    'tp2': (2, dict(tp=2), None),
    'pp2': (2, dict(pp=2, pipeline=dict(schedule='1F1B',
                                        num_microbatches=2)), None),
    'pp2_tp2': (4, dict(pp=2, tp=2, pipeline=dict(schedule='1F1B',
                                                  num_microbatches=2)),
                None),
}
TP_PLANS = dict(Llama='llama', HFCausalLM='hf')


def make_hf_dir(path: str, seed: int = 0) -> str:
    """A random LlamaForCausalLM written by save_pretrained (offline)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**HF_CONFIG)).save_pretrained(path)
    return path


def hf_logits(path: str, inputs: torch.Tensor) -> torch.Tensor:
    """Hugging Face's own forward of the weights in ``path``."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        return model.eval()(input_ids=inputs).logits


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
    return make_hf_dir(str(tmp_path_factory.mktemp('hf_llama')))


def _batches():
    return make_token_batches(num=4, batch_size=4, seq_len=16, vocab_size=64)


def _logits_rows(logits, data_samples):
    # Test-only predict output: the logits themselves, one row per sample.
    return list(logits.detach())


def _logits(model, inputs) -> torch.Tensor:
    from mmpar.wrappers import describe
    if describe(model).pipeline is not None:
        # Every pp rank gets the last stage's predictions (here: logits).
        rows = model.val_step(dict(inputs=inputs, data_samples=inputs))
        return torch.stack(rows)
    with torch.no_grad():
        return getattr(model, 'module', model)(inputs, mode='tensor')


def _load_from(model, path: str) -> None:
    """What ``load_from=path`` runs: the Runner's own load_checkpoint."""
    from mmpar.runner import Runner
    runner = types.SimpleNamespace(
        model=model, optim_wrapper=None, _has_loaded=False,
        _after_load_hooks=lambda checkpoint: None,
        logger=types.SimpleNamespace(info=lambda msg: None))
    Runner.load_checkpoint(runner, path, strict=True)


def round_trip(model_cfg: dict, parallel, wrapper_cfg, hf_dir: str,
               out_dir: str):
    """Load ``hf_dir`` in this layout, logits; train 3 steps, logits,
    export to ``out_dir`` (rank 0). Returns both logits."""
    from mmpar.checkpoint import model_state
    from mmpar.models.hf_weights import save_hf_checkpoint
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    from mmpar.registry import MODELS
    torch.manual_seed(1)  # weights other than hf_dir's until loaded
    model = MODELS.build(model_cfg)
    model.pipeline_predict = _logits_rows
    topology = None
    if dist.is_initialized():
        if parallel and parallel.get('tp', 1) > 1:
            parallel = dict(parallel, tp_plan=TP_PLANS[model_cfg['type']])
        topology = setup_parallelism(parallel, wrapper_cfg)
    model = parallelize(model, topology, parallel, wrapper_cfg)
    if model_cfg['type'] == 'Llama':
        _load_from(model, hf_dir)
    inputs = _batches()[0]['inputs']
    loaded = _logits(model, inputs)
    optim_wrapper = make_optim_wrapper(model, lr=0.05)
    for batch in _batches()[1:]:
        model.train_step(batch, optim_wrapper)
    trained = _logits(model, inputs)
    state = model_state(model)  # a collective: every rank
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_hf_checkpoint(model, state, out_dir)
    if dist.is_initialized():
        dist.barrier()
    return loaded, trained


def _model_cfg(name: str, hf_dir: str) -> dict:
    if name == 'HFCausalLM':
        return dict(type='HFCausalLM', pretrained=hf_dir)
    return copy.deepcopy(LLAMA)


def _check(results, hf_dir, out_dir):
    inputs = _batches()[0]['inputs']
    before, after = hf_logits(hf_dir, inputs), hf_logits(out_dir, inputs)
    assert not torch.allclose(before, after, atol=1e-3)  # it trained
    for rank, (loaded, trained) in enumerate(results):
        loaded_diff = (loaded - before).abs().max().item()
        trained_diff = (trained - after).abs().max().item()
        assert loaded_diff <= ATOL, f'rank {rank}: loaded {loaded_diff}'
        assert trained_diff <= ATOL, f'rank {rank}: exported {trained_diff}'


@pytest.mark.parametrize('name', ['HFCausalLM', 'Llama'])
def test_one_process_round_trip(hf_dir, tmp_path, name):
    out = str(tmp_path / 'exported')
    _check([round_trip(_model_cfg(name, hf_dir), None, None, hf_dir, out)],
           hf_dir, out)


@pytest.mark.parametrize('layout', list(LAYOUTS))
@pytest.mark.parametrize('name', ['HFCausalLM', 'Llama'])
def test_layout_round_trip(run_dist, hf_dir, tmp_path, name, layout):
    world_size, parallel, wrapper_cfg = LAYOUTS[layout]
    out = str(tmp_path / 'exported')
    results = run_dist(round_trip, _model_cfg(name, hf_dir), parallel,
                       wrapper_cfg, hf_dir, out, world_size=world_size)
    _check(results, hf_dir, out)
