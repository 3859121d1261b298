"""The Llama model: shapes, causality, GQA, tied weights, tensor-parallel
readiness, pipeline split points, deterministic initialisation."""
import copy

import pytest
import torch

from mmpar.models import Llama, TP_PLAN, pipeline_split_points
from mmpar.models.llama import Attention, FeedForward
from mmpar.registry import MODELS

TINY = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=16)


def _model(**kwargs):
    torch.manual_seed(0)
    return Llama(**{**TINY, **kwargs})


def test_registered_and_shapes():
    model = MODELS.build(dict(type='Llama', **TINY))
    tokens = torch.randint(0, 64, (3, 10))
    assert model(tokens, mode='tensor').shape == (3, 10, 64)
    loss = model(tokens, tokens.roll(-1, 1), mode='loss')['loss']
    assert loss.ndim == 0 and loss.requires_grad
    # Untrained: near the uniform-guess loss log(64).
    assert abs(loss.item() - torch.log(torch.tensor(64.)).item()) < 0.5
    preds = model(tokens, tokens, mode='predict')
    assert len(preds) == 3 and preds[0]['num_tokens'] == 10
    mean = sum(p['loss_sum'] for p in preds) / 30
    assert mean == pytest.approx(
        model(tokens, tokens, mode='loss')['loss'].item(), rel=1e-5)


def test_causal():
    model = _model()
    tokens = torch.randint(0, 64, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 64
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_grouped_query_attention():
    model = _model(num_kv_heads=2)
    attn = model.layers['0'].attn
    assert attn.wq.weight.shape == (32, 32)
    assert attn.wk.weight.shape == (16, 32)
    # GQA equals MHA whose key/value heads are each repeated per group.
    mha = Attention(32, 4, 4, 8)
    mha.wq.weight.data.copy_(attn.wq.weight)
    mha.wo.weight.data.copy_(attn.wo.weight)
    for name in ('wk', 'wv'):
        w = getattr(attn, name).weight.view(2, 8, 32)
        getattr(mha, name).weight.data.copy_(
            w.repeat_interleave(2, dim=0).reshape(32, 32))
    x = torch.randn(2, 5, 32)
    cos, sin = model.rope_cos, model.rope_sin
    torch.testing.assert_close(attn(x, cos, sin), mha(x, cos, sin))


def test_bad_sizes_name_the_key():
    with pytest.raises(ValueError, match='model.num_heads=5'):
        Llama(dim=32, num_heads=5)
    with pytest.raises(ValueError, match='model.num_kv_heads=3'):
        Llama(dim=32, num_heads=4, num_kv_heads=3)


def test_tied_embeddings():
    model = _model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    untied = _model()
    assert len(list(model.parameters())) == len(list(untied.parameters())) - 1
    assert model.num_params() == untied.num_params()  # the head counts
    assert 'output.weight' in model.state_dict()


def test_deterministic_init_and_state_dict_keys():
    a, b = _model(), _model()
    for (ka, va), (kb, vb) in zip(a.state_dict().items(),
                                  b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    # The rotary tables are derived, not saved.
    assert not any('rope' in k for k in a.state_dict())
    assert 'layers.1.attn.wq.weight' in a.state_dict()
    # reset_parameters (the meta-device path) is deterministic too, and
    # gives the documented spread.
    c, d = copy.deepcopy(a), copy.deepcopy(a)
    for m in (c, d):
        torch.manual_seed(1)
        m.reset_parameters()
    for k, v in c.state_dict().items():
        assert torch.equal(v, d.state_dict()[k]), k
    assert c.layers['0'].attn.wq.weight.std().item() == pytest.approx(
        0.02, rel=0.1)
    assert c.layers['0'].attn.wo.weight.std().item() == pytest.approx(
        0.01, rel=0.1)


def _shard_rows(linear, rank, world):
    return linear.weight.detach().chunk(world, dim=0)[rank]


def _shard_cols(linear, rank, world):
    return linear.weight.detach().chunk(world, dim=1)[rank]


@pytest.mark.parametrize('num_kv_heads', [4, 2])
def test_attention_splits_by_heads(num_kv_heads):
    """A column split of wq/wk/wv and a row split of wo: the per-shard
    outputs sum to the full output, the head count coming from the shapes."""
    torch.manual_seed(0)
    full = Attention(32, 4, num_kv_heads, 8)
    x = torch.randn(2, 6, 32)
    model = _model()
    cos, sin = model.rope_cos, model.rope_sin
    world = 2
    total = 0
    for rank in range(world):
        part = Attention(32, 4 // world, num_kv_heads // world, 8)
        for name in ('wq', 'wk', 'wv'):
            getattr(part, name).weight.data.copy_(
                _shard_rows(getattr(full, name), rank, world))
        part.wo.weight.data.copy_(_shard_cols(full.wo, rank, world))
        total = total + part(x, cos, sin)
    torch.testing.assert_close(total, full(x, cos, sin), rtol=1e-5,
                               atol=1e-6)


def test_mlp_splits_by_hidden_units():
    torch.manual_seed(0)
    full = FeedForward(32, 64)
    x = torch.randn(2, 6, 32)
    total = 0
    for rank in range(2):
        part = FeedForward(32, 32)
        part.w1.weight.data.copy_(_shard_rows(full.w1, rank, 2))
        part.w3.weight.data.copy_(_shard_rows(full.w3, rank, 2))
        part.w2.weight.data.copy_(_shard_cols(full.w2, rank, 2))
        total = total + part(x)
    torch.testing.assert_close(total, full(x), rtol=1e-5, atol=1e-6)


def test_tp_plan_names_real_modules():
    import fnmatch

    from mmpar.parallelize.module_plan import STYLES
    names = [n for n, _ in _model().named_modules()]
    allowed = set(STYLES)
    for pattern, entry in TP_PLAN.items():
        # A style, or a dict with its layouts (the gathered output head).
        style = entry['style'] if isinstance(entry, dict) else entry
        assert style in allowed
        assert fnmatch.filter(names, pattern), pattern


def test_pipeline_split_points():
    assert pipeline_split_points(4, 2) == ['layers.2']
    assert pipeline_split_points(8, 4) == ['layers.2', 'layers.4', 'layers.6']
    # The remainder goes to the middle stage, then the first (the last one
    # also carries the output head).
    assert pipeline_split_points(4, 3) == ['layers.1', 'layers.3']
    assert pipeline_split_points(5, 3) == ['layers.2', 'layers.4']
    assert pipeline_split_points(3, 1) == []
    with pytest.raises(ValueError, match='num_layers=2'):
        pipeline_split_points(2, 3)


def test_stages_compose_to_the_full_model():
    """Splitting at the default points (deleting blocks, setting the ends to
    None) and chaining the stages gives the full model's logits."""
    model = _model(num_layers=4)
    tokens = torch.randint(0, 64, (2, 8))
    points = pipeline_split_points(4, 2)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    cut = int(points[0].split('.')[1])
    for key in list(model.layers):
        del (last if int(key) < cut else first).layers[key]
    first.norm = first.output = None
    last.tok_embeddings = None
    torch.testing.assert_close(last.logits(first.logits(tokens)),
                               model.logits(tokens))


def test_flops_per_token():
    model = _model()
    n = model.num_params()
    assert n == sum(p.numel() for p in model.parameters()) - 64 * 32
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 4 * 8 * 16


def test_meta_device_build_then_initialise():
    """Built on the meta device (no memory), materialised, then
    reset_parameters: the path that initialises after parallelising."""
    with torch.device('meta'):
        model = Llama(**TINY)
    assert model.output.weight.is_meta
    model.to_empty(device='cpu')
    torch.manual_seed(0)
    model.reset_parameters()
    tokens = torch.randint(0, 64, (2, 8))
    logits = model(tokens)
    assert torch.isfinite(logits).all()
    assert model.rope_cos.device.type == 'cpu'
    torch.testing.assert_close(model.rope_cos, _model().rope_cos)


def test_documented_tp_plan_is_the_shipped_one():
    """docs/tensor_parallel.md shows TP_PLAN as the example of
    prepare_input: it must stay the plan that ships."""
    import re
    from pathlib import Path
    page = Path(__file__).resolve().parents[2] / 'docs' / 'tensor_parallel.md'
    block = re.search(r'```python\n(TP_PLAN = \{.*?\n\})\n```',
                      page.read_text(), re.S).group(1)
    shown = {}
    exec(block, {}, shown)
    assert shown['TP_PLAN'] == TP_PLAN
