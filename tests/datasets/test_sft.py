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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat_tokenizer(tmp_path, template=CHATML):
    """The shipped byte-level BPE with ChatML's special tokens and a chat
    template, saved as a local Hugging Face directory."""
    from mmpar.datasets.tokenizer import shakespeare_bpe
    hf = shakespeare_bpe().tokenizer
    hf.add_special_tokens(
        {'additional_special_tokens': ['<|im_start|>', '<|im_end|>']})
    hf.chat_template = template
    hf.save_pretrained(tmp_path / 'tok')
    return dict(type='HFTokenizer', path=str(tmp_path / 'tok'))


def test_hf_chat_template_counts_only_the_answers(tmp_path):
    chat = [dict(role='system', content='Be brief.'),
            dict(role='user', content='Who art thou?'),
            dict(role='assistant', content='A king.'),
            dict(role='user', content='Of where?'),
            dict(role='assistant', content='Of Denmark.')]
    files = _write(tmp_path / 'c.jsonl', [dict(messages=chat)])
    tokenizer = _chat_tokenizer(tmp_path)
    data = SFTDataset(files, context_length=96, tokenizer=tokenizer)
    assert data.template == 'hf'  # the default when a template exists
    hf = data.tokenizer.tokenizer
    whole = hf.apply_chat_template(chat, tokenize=False)
    ids, answer = data.samples[0]
    assert hf.decode(ids) == whole
    # The answer tokens: each assistant content and its end of turn,
    # neither the assistant header nor any system or user token.
    runs, run = [], []
    for token, counted in zip(ids.tolist() + [-1], answer.tolist() + [0]):
        if counted:
            run.append(token)
        elif run:
            runs, run = runs + [hf.decode(run)], []
    assert runs == ['A king.<|im_end|>\n', 'Of Denmark.<|im_end|>\n']
    targets = data[0]['data_samples']
    assert targets[targets != -100].tolist() == ids[1:][answer[1:]].tolist()
    plain = SFTDataset(files, context_length=96, tokenizer=tokenizer,
                       template='plain')
    assert plain.tokenizer.decode(plain.samples[0][0]).startswith(
        'Be brief.\n\n### Question:\nWho art thou?')
    with pytest.raises(ValueError, match="template='hf' needs an "
                       'HFTokenizer whose tokenizer has a chat_template'):
        SFTDataset(files, template='hf')  # bytes: no chat template
    with pytest.raises(ValueError, match="template='chat' is not supported"):
        SFTDataset(files, template='chat')
    # A template that renders earlier turns differently as the chat grows
    # (here: a message count up front) cannot be masked by prefixes.
    counting = _chat_tokenizer(tmp_path, '{{ messages|length }}' + CHATML)
    with pytest.raises(ValueError, match='does not render a chat'):
        SFTDataset(files, tokenizer=counting)
