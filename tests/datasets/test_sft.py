"""SFTDataset (mmpar/datasets/sft.py): only answer tokens are targets, and a
tiny Llama fine-tuned on 1,000 generated instruction records lowers the
masked loss while counting no prompt token."""
import json

import pytest
import torch

from mmpar.datasets import SFTDataset
from mmpar.models import Llama


def _records(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        a, b = torch.randint(0, 50, (2, ), generator=gen).tolist()
        yield dict(prompt=f'{a}+{b}=', response=str(a + b))


def _write(path, records):
    path.write_text(''.join(json.dumps(r) + '\n' for r in records))
    return str(path)


def test_only_answer_tokens_are_targets(tmp_path):
    files = _write(tmp_path / 'a.jsonl', [
        dict(prompt='hi', response='yo'),
        dict(messages=[dict(role='system', content='s'),
                       dict(role='user', content='q'),
                       dict(role='assistant', content='ab')])])
    data = SFTDataset(files, context_length=64)
    item = data[0]
    text = '### Question:\nhi\n\n### Answer:\nyo\n\n'
    assert bytes(item['inputs'][:len(text) - 1].tolist()) == \
        text[:-1].encode()
    counted = item['data_samples'][item['data_samples'] != -100]
    assert bytes(counted.tolist()) == b'### Answer:\nyo\n\n'
    assert (item['inputs'][len(text) - 1:] == 0).all()  # padding
    second = data[1]['data_samples']
    assert bytes(second[second != -100].tolist()) == b'### Answer:\nab\n\n'
    with pytest.raises(KeyError, match='needs "messages"'):
        SFTDataset(_write(tmp_path / 'b.jsonl', [dict(text='x')]))


@pytest.fixture
def one_thread():
    # Two threads on a shared 2-core machine ran this 50x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_fine_tuning_lowers_the_masked_loss(tmp_path, one_thread):
    data = SFTDataset(_write(tmp_path / 'sft.jsonl', _records(1000)),
                      context_length=48)
    assert len(data) == 1000
    assert max(len(ids) for ids, _ in data.samples) <= 49  # none cut
    torch.manual_seed(0)
    model = Llama(vocab_size=256, dim=32, num_layers=2, num_heads=2,
                  max_seq_len=48)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = torch.utils.data.DataLoader(data, batch_size=50)
    losses = []
    for batch in batches:
        out = model(batch['inputs'], batch['data_samples'], 'loss')
        # The count is the answer tokens' alone ("### Answer:\n", the sum
        # and "\n\n" of each record): no prompt token.
        first = len(losses) * 50
        expected = sum(int(data.samples[i][1][1:].sum())
                       for i in range(first, first + 50))
        assert int(out['num_tokens']) == expected
        out['loss'].backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(out['loss'].detach()))
    assert losses[-1] < 0.6 * losses[0], losses
