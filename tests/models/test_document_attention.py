"""Packing with document boundaries (mmpar/datasets/packed.py +
mmpar/parallelize/documents.py): a packed window run through the Llama with
its document ids gives every document the logits and the loss it gets run
alone, in one process, on cp=2 ranks and through a pp=2 pipeline (fp32
tolerance stated below); with a pipelined model whose stages are not handed
the document ids the option is refused at start-up, naming the key."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mmengine.config import Config

from mmpar.config_check import check_config
from mmpar.datasets import PackedTokenDataset, write_token_shard
from mmpar.failures import ConfigError
from mmpar.models import Llama
from mmpar.parallelize.context import apply_context_parallel, shard_batch
from mmpar.parallelize.documents import (document_positions,
                                        document_rotary)

# Five documents, 29 tokens: one window of 28 inputs holds them all (28
# divides by 2 x cp for cp = 2).
LENGTHS = (5, 9, 3, 7, 5)
# fp32: masked attention over the packed window against attention over each
# document alone sums the same terms in another order.
RTOL, ATOL = 1e-5, 1e-5


def _packed_window(directory, reverse=False):
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n, ), generator=gen).tolist()
            for n in LENGTHS]
    if reverse:
        docs = docs[::-1]
    name = f'{directory}/docs' + ('_reversed' if reverse else '')
    write_token_shard(name, docs, 256)
    data = PackedTokenDataset([name],
                              context_length=sum(LENGTHS) - 1,
                              document_attention=True)
    assert len(data) == 1
    return docs, {k: v[None] for k, v in data[0].items()}


def _model_with(num_layers=2):
    torch.manual_seed(0)
    return Llama(vocab_size=256, dim=32, num_layers=num_layers, num_heads=4,
                 num_kv_heads=2, max_seq_len=32)


def _model():
    return _model_with()


def _alone(model, docs):
    """Per document run alone: its logits and the sum of its token
    losses; and the number of targets."""
    logits, loss_sum, count = [], 0.0, 0
    for doc in docs:
        tokens = torch.as_tensor(doc)[None]
        out = model.logits(tokens[:, :-1])
        logits.append(out[0])
        loss_sum = loss_sum + F.cross_entropy(out[0], tokens[0, 1:],
                                              reduction='sum')
        count += len(doc) - 1
    return logits, loss_sum, count


def _packed_parts(logits, docs):
    """The packed logits cut back into documents (the last token of each
    predicts nothing counted, so a document's part is its inputs)."""
    parts, start = [], 0
    for doc in docs:
        parts.append(logits[start:start + len(doc) - 1])
        start += len(doc)
    return parts


def test_document_positions_restart():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]])
    positions = [[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]]
    assert document_positions(doc_ids).tolist() == positions
    # The rotary tables at those positions. (Rotary scores depend on
    # relative positions only, so within a document the restart changes no
    # logit beyond rounding: the parity tests below cannot see it.)
    table = torch.arange(8.0)[:, None].expand(8, 2)
    cos, sin = document_rotary(table, -table, doc_ids, 6, None)
    assert cos[..., 0].tolist() == positions
    assert sin[..., 1].tolist() == [[-p for p in row] for row in positions]
    with pytest.raises(ValueError, match=r'must be \(batch, 12\)'):
        document_rotary(table, table, doc_ids, 12, None)


@pytest.mark.parametrize('device', [
    'cpu',
    # The same masks through the accelerator's attention kernels
    # (bash tools/gpu_check.sh); skipped without CUDA.
    pytest.param('cuda', marks=pytest.mark.gpu)])
def test_packed_loss_is_the_sum_of_document_losses(tmp_path, device):
    docs, batch = _packed_window(tmp_path)
    batch = {k: v.to(device) for k, v in batch.items()}
    docs = [torch.tensor(doc, device=device) for doc in docs]
    model = _model().to(device)
    out = model(batch['inputs'], batch['data_samples'], 'loss',
                doc_ids=batch['doc_ids'])
    logits = model(batch['inputs'], mode='tensor', doc_ids=batch['doc_ids'])
    alone_logits, alone_sum, count = _alone(model, docs)
    # Only the document's own targets count: none across a boundary.
    assert int(out['num_tokens']) == count == sum(LENGTHS) - len(LENGTHS)
    torch.testing.assert_close(out['loss'] * out['num_tokens'], alone_sum,
                               rtol=RTOL, atol=ATOL)
    for part, ref in zip(_packed_parts(logits[0], docs), alone_logits):
        torch.testing.assert_close(part, ref, rtol=RTOL, atol=ATOL)
    # Without document attention the later documents see the earlier ones.
    plain = model(batch['inputs'], mode='tensor')
    assert not torch.allclose(plain, logits, rtol=RTOL, atol=ATOL)


def _cp_packed(directory):
    docs, batch = _packed_window(directory)
    model = _model()
    _, alone_sum, count = _alone(model, docs)
    whole = model(batch['inputs'], mode='tensor', doc_ids=batch['doc_ids'])
    apply_context_parallel(model, dist.group.WORLD)
    local = shard_batch(model, batch)
    # Every cp rank keeps the whole document ids.
    assert torch.equal(local['doc_ids'], batch['doc_ids'])
    out = model(**local, mode='loss')
    sums = torch.stack([out['loss'].detach() * out['num_tokens'],
                        out['num_tokens']]).double()
    dist.all_reduce(sums)
    logits = model(**{k: v for k, v in local.items()
                      if k != 'data_samples'}, mode='tensor')
    torch.testing.assert_close(logits, model.context_parallel.shard(whole),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(sums[0].float(), alone_sum.detach(),
                               rtol=RTOL, atol=ATOL)
    return int(sums[1]), count


def test_cp_chunks_keep_their_document_masks(run_dist, tmp_path):
    for counted, count in run_dist(_cp_packed, str(tmp_path)):
        assert counted == count


class _LogitsLlama(Llama):
    """The Llama, predicting its logits (a test's view of the last
    stage's outputs) next to the per-sample losses."""

    def pipeline_predict(self, logits, data_samples):
        preds = super().pipeline_predict(logits, data_samples)
        return [dict(p, logits=row.detach()) for p, row in zip(preds, logits)]


def _pp_packed(directory, schedule, stages_per_rank):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    docs, batch = _packed_window(directory)
    # Two windows, one per micro-batch: the packed one and its documents in
    # reverse order, so each micro-batch needs its own rows of doc_ids.
    _, flipped = _packed_window(directory, reverse=True)
    batch = {k: torch.cat([batch[k], flipped[k]]) for k in batch}
    torch.manual_seed(0)
    model = _LogitsLlama(vocab_size=256, dim=32, num_layers=4, num_heads=4,
                         num_kv_heads=2, max_seq_len=32)
    parallel = dict(pp=2, pipeline=dict(
        schedule=schedule, num_microbatches=2,
        stages_per_rank=stages_per_rank))
    topology = setup_parallelism(parallel, None)  # reset by the harness
    pipelined = parallelize(model, topology, parallel, None)
    return pipelined.val_step(dict(batch))


@pytest.mark.parametrize('schedule,stages_per_rank', [
    ('1F1B', 1), ('Interleaved1F1B', 2)])
def test_pipeline_stages_keep_their_document_masks(run_dist, tmp_path,
                                                   schedule,
                                                   stages_per_rank):
    docs, batch = _packed_window(tmp_path)
    reference = _model_with(num_layers=4)
    count = sum(LENGTHS) - len(LENGTHS)
    for preds in run_dist(_pp_packed, str(tmp_path), schedule,
                          stages_per_rank):
        for pred, order in zip(preds, (docs, docs[::-1])):
            logits, alone_sum, _ = _alone(reference, order)
            for part, ref in zip(_packed_parts(pred['logits'], order),
                                 logits):
                torch.testing.assert_close(part, ref, rtol=RTOL, atol=ATOL)
            assert pred['num_tokens'] == count
            assert pred['loss_sum'] == pytest.approx(float(alone_sum),
                                                     rel=RTOL, abs=ATOL)


def test_pipeline_refuses_document_attention_without_pipeline_kwargs():
    cfg = Config.fromfile(
        'configs/llama_shakespeare/llama_shakespeare_pp.py')
    cfg.train_dataloader.dataset = dict(
        type='PackedTokenDataset', sources=['unused'], context_length=128,
        document_attention=True)
    check_config(cfg, 2)  # the Llama hands doc_ids to every stage
    cfg.model.type = _PlainStagesLlama
    with pytest.raises(ConfigError) as err:
        check_config(cfg, 2)
    assert 'train_dataloader.dataset.document_attention=True is not ' \
        'supported with parallel.pp=2' in str(err.value)
    assert 'allowed: document_attention=False' in str(err.value)


class _PlainStagesLlama(Llama):
    pipeline_kwargs = ()


def test_model_without_doc_ids_refuses_document_attention():
    from mmpar.datasets.packed_check import check_document_attention
    cfg = dict(model=dict(type='HFCausalLM'),
               val_dataloader=dict(dataset=dict(document_attention=True)))
    with pytest.raises(ConfigError, match=r"val_dataloader.dataset."
                       r"document_attention=True needs a model whose "
                       r"forward takes doc_ids; model.type='HFCausalLM'"):
        check_document_attention(cfg, 1)
    cfg['model'] = dict(type='Llama')
    check_document_attention(cfg, 1)
