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
    # The answer's content and the end of its format, not its constant
    # header '### Answer:\n' (a prompt token, as in the 'hf' path).
    assert bytes(counted.tolist()) == b'yo\n\n'
    assert (item['inputs'][len(text) - 1:] == 0).all()  # padding
    second = data[1]['data_samples']
    assert bytes(second[second != -100].tolist()) == b'ab\n\n'
    # Cut to 8 inputs: the start (all prompt), or the end (the answer).
    right, left = (SFTDataset(files, context_length=8, truncate=t,
                              num_windows=1) for t in ('right', 'left'))
    assert len(right) == 1 and (right[0]['data_samples'] == -100).all()
    assert bytes(left[0]['inputs'].tolist()) == b'wer:\nyo\n'
    assert left[0]['data_samples'].tolist() == \
        [-100] * 4 + list(b'yo\n\n')
    # A dict template: the assistant's format cut at {content}.
    custom = SFTDataset(files, template={'system': '{content}',
                                        'user': 'U:{content}\n',
                                        'assistant': '<a>{content}</a>'})
    counted = custom[1]['data_samples'][custom[1]['data_samples'] != -100]
    assert bytes(counted.tolist()) == b'ab</a>'
    with pytest.raises(ValueError, match="truncate='middle' is not"):
        SFTDataset(files, truncate='middle')
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
        # The count is the answer tokens' alone (the sum and "\n\n" of
        # each record): no prompt token, nor the "### Answer:\n" header.
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


def test_packed_records_get_the_loss_they_get_alone(tmp_path, one_thread):
    records = [dict(prompt='ab' * n, response=str(n) * (n % 3 + 1))
               for n in (1, 9, 4, 2, 7, 3)]
    files = _write(tmp_path / 'p.jsonl', records)
    alone = SFTDataset(files, context_length=96)
    packed = SFTDataset(files, context_length=96, pack=True,
                        document_attention=True)
    lengths = [len(ids) - 1 for ids, _ in alone.samples]  # 33 48 39 36 45 36
    assert packed.windows == [[0, 1], [2, 3], [4, 5]]
    assert all(sum(lengths[i] for i in w) <= 96 for w in packed.windows)
    torch.manual_seed(0)
    model = Llama(vocab_size=256, dim=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_seq_len=96)
    for idx, window in enumerate(packed.windows):
        item = {k: v[None] for k, v in packed[idx].items()}
        out = model(item['inputs'], item['data_samples'], 'loss',
                    doc_ids=item['doc_ids'])
        logits = model(item['inputs'], mode='tensor',
                       doc_ids=item['doc_ids'])[0]
        loss_sum, count, start = 0.0, 0, 0
        for d, record in enumerate(window):
            ref = {k: v[None] for k, v in alone[record].items()}
            ref_out = model(ref['inputs'], ref['data_samples'], 'loss')
            n = lengths[record]
            part = slice(start, start + n)
            assert (item['doc_ids'][0, part] == d).all()
            # A record's targets are its own: none across records.
            assert torch.equal(item['data_samples'][0, part],
                               ref['data_samples'][0, :n])
            torch.testing.assert_close(
                logits[part], model(ref['inputs'], mode='tensor')[0, :n],
                rtol=1e-5, atol=1e-5)
            loss_sum = loss_sum + ref_out['loss'] * ref_out['num_tokens']
            count += int(ref_out['num_tokens'])
            start += n
        assert (item['data_samples'][0, start:] == -100).all()  # padding
        assert int(out['num_tokens']) == count
        torch.testing.assert_close(out['loss'] * out['num_tokens'],
                                   loss_sum, rtol=1e-5, atol=1e-5)
    assert 'doc_ids' not in SFTDataset(files, context_length=96,
                                       pack=True)[0]
    with pytest.raises(ValueError, match='document_attention=True needs '
                       'pack=True'):
        SFTDataset(files, document_attention=True)


def test_shipped_instruction_set_is_regenerated():
    from mmpar.datasets.shakespeare_sft import SFT_DIR, sft_file_texts
    texts = sft_file_texts()
    for split, text in texts.items():
        assert (SFT_DIR / f'shakespeare_sft_{split}.jsonl').read_text() == text
    records = [json.loads(line) for text in texts.values()
               for line in text.splitlines()]
    assert len(records) == 1000
    assert sum('messages' in r for r in records) == 500
    # Every record fits the shipped config's context: none is cut.
    data = SFTDataset('mmpar:shakespeare_sft_train.jsonl')
    assert max(len(ids) for ids, _ in data.samples) <= 129


def test_records_may_hold_raw_line_separators(tmp_path):
    path = tmp_path / 'ls.jsonl'
    record = dict(prompt='Q\u2028?', response='A\x85!')
    path.write_text(json.dumps(record, ensure_ascii=False) + '\n',
                    encoding='utf-8')
    data = SFTDataset(str(path), context_length=64)
    assert len(data) == 1
    assert 'Q\u2028?'.encode() in bytes(data[0]['inputs'].tolist())


@pytest.mark.parametrize('line,error,match', [
    ('{"prompt": "a", "response": }', ValueError,
     r'bad\.jsonl:2: not a JSON record'),
    ('{"prompt": "a", "response": null}', TypeError,
     r"bad\.jsonl:2: message 1 is .*'content': None"),
    ('{"messages": [{"role": "user", "content": [{"text": "a"}]}]}',
     TypeError, r'bad\.jsonl:2: message 0'),
    ('{"messages": [{"content": "a"}]}', TypeError, 'message 0'),
    ('[1, 2]', KeyError, "its keys: none: a list"),
], ids=['not json', 'null content', 'list content', 'no role', 'a list'])
def test_a_bad_record_is_named_by_file_and_line(tmp_path, line, error,
                                                match):
    # They failed deep (a bare JSONDecodeError or KeyError naming no file),
    # or trained the text "None" / a list's repr as the answer.
    path = tmp_path / 'bad.jsonl'
    path.write_text('{"prompt": "q", "response": "r"}\n' + line + '\n')
    with pytest.raises(error, match=match):
        SFTDataset(str(path), context_length=64)


@pytest.mark.parametrize('pad_id', [256, -1, 1.5])
def test_a_pad_id_outside_the_vocabulary_is_refused(tmp_path, pad_id):
    # It failed at the first padded batch with "index out of range" in the
    # embedding (bytes: ids 0-255).
    path = tmp_path / 'r.jsonl'
    path.write_text('{"prompt": "q", "response": "r"}\n')
    with pytest.raises(ValueError, match=rf'pad_id={pad_id}.*0 to 255'):
        SFTDataset(str(path), context_length=64, pad_id=pad_id, pack=False)
