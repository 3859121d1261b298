"""A Hugging Face MoE model (transformers' Mixtral, built offline from its
config) trains under expert parallelism through ``tools/dist_train.sh`` as
``tools/train.py`` trains it on one process with the same global batch:
ep=2 on 2 ranks (Qwen3-MoE too, switched by ``--cfg-options``), and on 4
ranks ep=2 with dp_shard=2 (each rank half of its 2 experts), with tp=2
(transformers' plan, the MoE layers whole on every tp rank), with pp=2 and
with cp=2. The same logged losses and global gradient norms (the clip
bites), final weights and Adam moments; the router and top-k are Hugging
Face's, the experts run through mmpar's function in transformers'
``ExpertsInterface``, which dispatches the routed tokens to their
experts' ranks. The ep=2 x dp_shard=2 run's checkpoint exports with
``convert_checkpoint.py --to hf``, ``from_pretrained`` loads it (the
experts whole), and ``HFCausalLM(pretrained=...)`` reads it back.
"""
import pytest
import torch

from mmpar.convert import main as convert_main
from tests.configs.test_llama_configs import SHRINK as LLAMA_SHRINK
from tests.e2e import load_ckpt, run_tool
from tests.tools.ep_logs import (assert_matches_one_process,
                                 train_one_process)

CONFIG = 'configs/hf_finetune/mixtral_shakespeare_hf_moe.py'
EP_CONFIG = 'configs/hf_finetune/mixtral_shakespeare_hf_moe_ep.py'
SHRINK = [f'model.config.{k}={v}' for k, v in dict(
    hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2).items()]
OPTIONS = SHRINK + [
    'train_dataloader.dataset.context_length=32',
    'default_hooks.logger.interval=1', 'train_cfg.max_iters=3',
    'train_cfg.val_interval=100', 'default_hooks.checkpoint.interval=3',
    # a clip that bites: the norm must be the global one to match
    'optim_wrapper.clip_grad.max_norm=0.5'] + [
    # Validated at the last iteration, as every run is, on the Llama
    # configs' 8 short windows: the comparisons are of the training
    # (validation changes no weight); the config's split cost each launch
    # about a second, 14 batches of 64 x 128 tokens.
    f'{k}={v}' for k, v in LLAMA_SHRINK.items()
    if k.startswith('val_dataloader.')]
BATCH = 4  # the global batch
EXPERTS = 'hf_model.model.layers.0.mlp.experts.gate_up_proj'
# The model switch (--cfg-options on the Mixtral configs): options for both
# runs, and for the ep run's FSDP2 units.
MODELS = {
    'mixtral': ([], []),
    'qwen3_moe': ([f'model.config.{k}={v}' for k, v in dict(
        model_type='qwen3_moe', num_experts=4, moe_intermediate_size=32,
        head_dim=16).items()],
        ['model_wrapper_cfg.fsdp_auto_wrap_policy.module_classes='
         '[Qwen3MoeDecoderLayer]']),
}
PIPELINE = ['parallel.pp=2', 'parallel.pipeline.schedule=1F1B',
            'parallel.pipeline.num_microbatches=2']


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
    """The one-process reference of a model of :data:`MODELS`, with the
    layouts' global batch: trained on first use, once per module."""
    runs = {}

    def reference(model: str) -> tuple:
        if model not in runs:
            runs[model] = train_one_process(
                CONFIG, tmp_path_factory.mktemp(model),
                [*OPTIONS, *MODELS[model][0]], BATCH)
        return runs[model]
    return reference


@pytest.mark.parametrize('model,ranks,data_ranks,extra,layout,export', [
    ('mixtral', 2, 2, [], 'parallel = dict(ep=2)', False),
    ('qwen3_moe', 2, 2, [], 'parallel = dict(ep=2)', False),
    # exported once: the experts split over ep and sharded over dp_shard
    ('mixtral', 4, 4, ['parallel.dp_shard=2'],
     'parallel = dict(dp_shard=2, ep=2)', True),
    # transformers' own plan, its tensor-parallel experts left out: each tp
    # pair runs the MoE layers whole on the same samples
    ('mixtral', 4, 2, ['parallel.tp=2', 'parallel.tp_plan=hf'],
     "parallel = dict(ep=2, tp=2, tp_plan='hf')", False),
    # 1F1B, 2 micro-batches: each stage's experts split over its ep ranks
    ('mixtral', 4, 2, PIPELINE, "ep=2, pipeline=dict(num_microbatches=2, "
     "schedule='1F1B'), pp=2", False),
    # each rank routes its part of every sequence, experts over efsdp=cp
    ('mixtral', 4, 2, ['parallel.cp=2'], 'parallel = dict(cp=2, ep=2)',
     False),
], ids=['ep2', 'qwen3_moe_ep2', 'ep2_dp_shard2', 'ep2_tp2', 'pp2_ep2',
        'ep2_cp2'])
def test_hf_moe_under_ep_matches_one_process(tmp_path, one_process, model,
                                             ranks, data_ranks, extra,
                                             layout, export):
    one_dir, one_log = one_process(model)
    ep = run_tool(['bash', 'tools/dist_train.sh', EP_CONFIG, ranks,
                   '--work-dir', tmp_path / 'ep', '--cfg-options', *OPTIONS,
                   *MODELS[model][0], *MODELS[model][1], *extra,
                   f'train_dataloader.batch_size={BATCH // data_ranks}'])
    ep_log = ep.stdout + ep.stderr
    assert layout in ep_log
    assert f"model_type='{model}'" in ep_log
    assert_matches_one_process(ep_log, tmp_path / 'ep', one_log, one_dir,
                               ('loss', 'grad_norm'), EXPERTS,
                               clip_every_step=True)
    if export:
        _export_loads(tmp_path, one_dir)


def _export_loads(tmp_path, one_dir):
    """Weights out and in: Hugging Face's own loader takes the export of
    the ep run's checkpoint, with one process's final weights."""
    from transformers import AutoModelForCausalLM

    from mmpar.models import HFCausalLM
    out = str(tmp_path / 'hf')
    convert_main([str(tmp_path / 'ep' / 'iter_3.pth'), '--to', 'hf',
                  '--config', EP_CONFIG, '--out', out, '--cfg-options',
                  *SHRINK])
    want = load_ckpt(one_dir / 'iter_3.pth')['state_dict']
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ours = HFCausalLM(pretrained=out)
    for name, weight in hf.state_dict().items():
        torch.testing.assert_close(weight, want[f'hf_model.{name}'],
                                   atol=1e-5, rtol=1e-4, msg=name)
        assert torch.equal(ours.state_dict()[f'hf_model.{name}'], weight)
