"""Tied weights are refused under tensor and pipeline parallelism, before
any training step: either layout holds the shared tensor as two (two
DTensor layouts, two stages), each trained on its own gradient, so the run
silently drifts from one process. Refused at the config check for Llama's
``tie_embeddings`` and HFCausalLM's ``tie_word_embeddings``, and where any
model is laid out (a user's own model: the parameter names that share one
tensor); data-parallel layouts, which keep one tensor, still accept them."""
import pytest
import torch
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.model import BaseModel
from torch import nn

from mmpar.config_check import check_config
from mmpar.failures import ConfigError
from mmpar.parallel.tied import refuse_shared_parameters, shared_parameters
from mmpar.parallelize.pipeline import check_protocol
from mmpar.registry import MODELS
from tests.configs.test_llama_configs import SHRINK
from tests.e2e import ROOT, run_tool

LLAMA_TP = 'configs/llama_shakespeare/llama_shakespeare_tp.py'
LLAMA_PP = 'configs/llama_shakespeare/llama_shakespeare_pp.py'
HF = 'configs/llama_shakespeare/llama_shakespeare_hf.py'
ALLOWED = ('or a layout without tp and pp (parallel.tp=1 and parallel.pp=1, '
           'e.g. DDP or FSDP2')
VOCAB, HIDDEN = 16, 8


class TiedLM(BaseModel):
    """A user's language model with its head tied to its embedding, meeting
    the pipeline protocol."""
    pipeline_layers = 'layers'
    pipeline_pre = ('embed', )
    pipeline_post = ('head', )

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN)
                                    for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def pipeline_embed(self, inputs):
        return self.embed(inputs)

    def pipeline_head(self, hidden):
        return self.head(hidden)

    def pipeline_loss(self, outputs, targets):
        return dict(loss=F.cross_entropy(outputs.flatten(0, 1),
                                         targets.flatten()))

    def pipeline_predict(self, outputs, targets):
        return outputs

    def forward(self, inputs, data_samples=None, mode='tensor'):
        hidden = self.pipeline_embed(inputs)
        for layer in self.layers:
            hidden = layer(hidden)
        outputs = self.pipeline_head(hidden)
        return self.pipeline_loss(outputs, data_samples) \
            if mode == 'loss' else outputs


def _cfg(config, **options):
    cfg = Config.fromfile(str(ROOT / config))
    cfg.merge_from_dict(options)
    return cfg


@pytest.mark.parametrize('config,options,message', [
    (LLAMA_TP, {'model.tie_embeddings': True},
     'model.tie_embeddings=True is not allowed with parallel.tp=2: tensor '
     'parallelism gives the tied modules different layouts'),
    (LLAMA_PP, {'model.tie_embeddings': True},
     'model.tie_embeddings=True is not allowed with parallel.pp=2: pipeline '
     'parallelism puts the tied modules on different stages'),
    (HF, {'model.config.tie_word_embeddings': True, 'parallel.tp': 2,
          'parallel.tp_plan': 'hf'},
     'model.config.tie_word_embeddings=True is not allowed with '
     'parallel.tp=2'),
], ids=['llama_tp2', 'llama_pp2', 'hf_tp2'])
def test_config_check_refuses_tied_weights_under_tp_or_pp(config, options,
                                                           message):
    with pytest.raises(ConfigError) as info:
        check_config(_cfg(config, **options), world_size=2)
    text = str(info.value)
    assert message in text
    assert 'the weights would silently untie' in text
    untie = next(iter(options)) + '=False'
    assert f'allowed: {untie}, {ALLOWED}' in text


@pytest.mark.parametrize('wrapper', [None, dict(type='MMFullyShard')],
                         ids=['ddp', 'fsdp2'])
def test_data_parallel_layouts_keep_tied_weights(wrapper):
    cfg = _cfg('configs/llama_shakespeare/llama_shakespeare.py',
               **{'model.tie_embeddings': True})
    if wrapper is not None:
        cfg.model_wrapper_cfg = wrapper
    assert check_config(cfg, world_size=2).dims.world_size == 2


def test_shared_parameters_lists_every_name_of_a_tensor():
    tiny = dict(type='Llama', vocab_size=16, dim=8, num_layers=1,
                num_heads=2, max_seq_len=8)
    assert shared_parameters(MODELS.build(dict(tiny, tie_embeddings=True))) \
        == [('tok_embeddings.weight', 'output.weight')]
    assert shared_parameters(MODELS.build(tiny)) == []
    # Under data parallelism alone nothing is refused.
    refuse_shared_parameters(TiedLM(), 1, 1)


def test_pipeline_split_refuses_a_users_tied_model():
    with pytest.raises(ConfigError, match=(
            r"TiedLM: parameters 'embed.weight' and 'head.weight' share one "
            r'tensor \(tied weights\), which is not allowed with '
            r'parallel.pp=2: .*allowed: untie them')):
        check_protocol(TiedLM(), 2)


def _lay_out(parallel):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    topology = setup_parallelism(parallel, None)  # reset by the harness
    torch.manual_seed(0)
    try:
        parallelize(TiedLM(), topology, parallel, None)
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize('parallel,layout', [
    (dict(tp=2, tp_plan=dict(type='module_plan', plan={
        'embed': 'rowwise',
        'head': dict(style='colwise', output_layouts='replicate')})),
     'parallel.tp=2'),
    (dict(pp=2, pipeline=dict(schedule='1F1B', num_microbatches=2)),
     'parallel.pp=2'),
], ids=['tp2', 'pp2'])
def test_laying_out_a_users_tied_model_is_refused_on_every_rank(
        run_dist, parallel, layout):
    """No config key tells: the built model is checked before the plan
    splits it (tp) or the stages are cut (pp)."""
    for message in run_dist(_lay_out, parallel):
        assert message is not None
        assert ("TiedLM: parameters 'embed.weight' and 'head.weight' share "
                f'one tensor (tied weights), which is not allowed with '
                f'{layout}') in message, message


def test_dist_train_refuses_tied_llama_under_tp(tmp_path):
    proc = run_tool(['bash', 'tools/dist_train.sh', LLAMA_TP, 2,
                     '--work-dir', tmp_path, '--cfg-options',
                     *(f'{k}={v}' for k, v in SHRINK.items()),
                     'model.tie_embeddings=True'], timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert 'model.tie_embeddings=True is not allowed with parallel.tp=2' \
        in output, output[-3000:]
    assert 'Iter(train)' not in output
