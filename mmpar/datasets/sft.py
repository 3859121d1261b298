"""Supervised fine-tuning records: the loss on the answer tokens only.

A record is a chat (``messages``: a list of ``dict(role, content)``) or an
instruction pair (``prompt`` and ``response``, read as a user and an
assistant message). With a Hugging Face tokenizer that has a chat template,
the chat is rendered by it (:mod:`mmpar.datasets.chat_template`);
otherwise each message is rendered by the format string of its role,
tokenized, and the rendered messages concatenated. A target counts only
where the token it predicts belongs to an assistant message, so the loss
(and the global token count it is normalised by) never counts a prompt
token. Each record is one sample, cut to ``context_length + 1`` tokens and
padded (targets ``-100``), or with ``pack=True`` several records share a
window (:mod:`mmpar.datasets.sft_packing`).
"""
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from mmpar.datasets.chat_template import (ANSWER_ROLE, has_chat_template,
                                          render_chat)
from mmpar.datasets.packed import check_count
from mmpar.datasets.sft_packing import (TRUNCATIONS, pack_records,
                                        packed_window, record_sample)
from mmpar.datasets.text_files import (expand_files, jsonl_records,
                                       record_keys)
from mmpar.datasets.tokenizer import (Tokenizer, build_tokenizer,
                                      lm_metainfo)
from mmpar.registry import DATASETS

# Role -> how a message is written; {content} is the message's text.
DEFAULT_TEMPLATE = {
    'system': '{content}\n\n',
    'user': '### Question:\n{content}\n\n',
    'assistant': '### Answer:\n{content}\n\n',
}
# The named choices of SFTDataset's ``template`` (besides a dict).
TEMPLATES = ('hf', 'plain')


def record_messages(record: dict, where: str) -> List[dict]:
    """A record's messages: ``messages``, or ``prompt`` + ``response``.

    Raises:
        KeyError: a record with neither.
        TypeError: a message that is not a dict with a ``role`` and a
            string ``content`` (a null would be trained as the text
            "None", a list of parts as its repr).
    """
    if isinstance(record, dict) and 'messages' in record:
        messages = list(record['messages'])
    elif isinstance(record, dict) and 'prompt' in record and \
            'response' in record:
        messages = [dict(role='user', content=record['prompt']),
                    dict(role=ANSWER_ROLE, content=record['response'])]
    else:
        raise KeyError(f'{where}: a record needs "messages" or "prompt" and '
                       f'"response"; its keys: {record_keys(record)}')
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and 'role' in message
                and isinstance(message.get('content'), str)):
            raise TypeError(
                f'{where}: message {index} is {message!r}; allowed: '
                "dict(role=..., content='a string')")
    return messages


def chosen_template(template: Union[str, Dict[str, str], None],
                    tokenizer: Tokenizer) -> Union[str, Dict[str, str]]:
    """``'hf'`` or the dict of format strings that ``template`` means:
    ``None`` is ``'hf'`` when the tokenizer has a chat template, else
    ``'plain'`` (:data:`DEFAULT_TEMPLATE`).

    Raises:
        ValueError: an unknown name, or ``'hf'`` without a chat template.
    """
    if template is None:
        template = 'hf' if has_chat_template(tokenizer) else 'plain'
    if isinstance(template, dict):
        return dict(template)
    if template not in TEMPLATES:
        raise ValueError(f'SFTDataset template={template!r} is not '
                         f'supported; allowed: {", ".join(TEMPLATES)}, None '
                         'or a dict role -> format string')
    if template == 'hf' and not has_chat_template(tokenizer):
        raise ValueError(
            "SFTDataset template='hf' needs an HFTokenizer whose tokenizer "
            f'has a chat_template; {getattr(tokenizer, "name", tokenizer)!r} '
            "has none; allowed: 'plain', None or a dict")
    return 'hf' if template == 'hf' else dict(DEFAULT_TEMPLATE)


def render(messages: Sequence[dict], tokenizer: Tokenizer,
           template: Union[str, Dict[str, str]]
           ) -> Tuple[np.ndarray, np.ndarray]:
    """``(token ids, is_answer)`` of a chat: with ``template='hf'`` by the
    tokenizer's chat template (:func:`render_chat`), else every message
    rendered by its role's format string and tokenized alone, in order; an
    assistant message's format is cut at ``{content}``: what precedes it
    (its header, e.g. ``'### Answer:\\n'``) is tokenized alone as prompt,
    the content and what follows it are the answer (as the ``'hf'`` path
    counts content and end of turn, not the header).

    Raises:
        ValueError: a role the template lacks.
    """
    if template == 'hf':
        return render_chat(messages, tokenizer)
    ids, answer = [], []
    for message in messages:
        role = message['role']
        if role not in template:
            raise ValueError(f'role {role!r} has no template; allowed: '
                             f'{", ".join(template)}')
        header, content = '', template[role]
        if role == ANSWER_ROLE and '{content}' in content:
            header, rest = content.split('{content}', 1)
            content = '{content}' + rest
        for text, is_answer in ((header.format(), False),
                                (content.format(content=message['content']),
                                 role == ANSWER_ROLE)):
            tokens = tokenizer.encode(text) if text else []
            ids += tokens
            answer += [is_answer] * len(tokens)
    return np.asarray(ids, np.int64), np.asarray(answer, bool)


@DATASETS.register_module()
class SFTDataset(Dataset):
    """Chat / instruction records from JSONL files, one padded sample each
    or packed, the loss on the answer tokens only.

    Args:
        files: JSONL paths, globs or directories.
        context_length: tokens per sample (longer records are cut).
        tokenizer: a ``TOKENIZERS`` config (``None``: bytes).
        template: ``'hf'``: the chat template of the tokenizer (an
            ``HFTokenizer``), loss on each assistant message's content and
            end-of-turn tokens; ``'plain'``: :data:`DEFAULT_TEMPLATE`; a
            dict role -> format string with ``{content}`` (the loss on an
            assistant message's content and what follows it in its format,
            not the header before it; :func:`render`); ``None``:
            ``'hf'`` when the tokenizer has a chat template, else
            ``'plain'``.
        pad_id: the input id of padding (its targets are ``-100``).
        pack: lay records one after another into windows of
            ``context_length`` inputs (a sample is then a window; no
            target predicts across records).
        document_attention: with ``pack``, items carry ``doc_ids`` (the
            record of each input) so that the model restarts positions at
            each record and attends within it: each record gets the loss
            it gets alone.
        num_windows: samples per epoch: the first ``num_windows`` (records,
            or windows with ``pack``); ``None``: all. E.g. a quick
            validation on part of a set.
        truncate: how a record longer than ``context_length + 1`` tokens
            is cut: ``'right'`` keeps its start, ``'left'`` its end (the
            last answer is trained even when the prompt is long).

    Each item is ``dict(inputs=int64 (L,), data_samples=int64 (L,))``, plus
    ``doc_ids=int64 (L,)`` with ``pack`` and ``document_attention``;
    ``data_samples`` is ``-100`` except where the next token is an answer
    token.

    Raises:
        ValueError: ``document_attention`` without ``pack``, or a bad
            ``template`` or ``context_length``.
    """

    def __init__(self,
                 files: Union[str, Sequence[str]],
                 context_length: int = 128,
                 tokenizer: Union[dict, Tokenizer, None] = None,
                 template: Union[str, Dict[str, str], None] = None,
                 pad_id: int = 0,
                 pack: bool = False,
                 document_attention: bool = False,
                 num_windows: Optional[int] = None,
                 truncate: str = 'right'):
        check_count('SFTDataset context_length', context_length)
        check_count('SFTDataset num_windows', num_windows, optional=True)
        if truncate not in TRUNCATIONS:
            raise ValueError(f'SFTDataset truncate={truncate!r} is not '
                             f'supported; allowed: {", ".join(TRUNCATIONS)}')
        if document_attention and not pack:
            raise ValueError('SFTDataset document_attention=True needs '
                             'pack=True (a padded sample holds one record); '
                             'allowed: pack=True, or document_attention=False')
        self.tokenizer = build_tokenizer(tokenizer)
        vocab_size = self.tokenizer.vocab_size
        if isinstance(pad_id, bool) or not isinstance(pad_id, int) or \
                not 0 <= pad_id < vocab_size:
            # (It would fail at the first padded batch, in the embedding.)
            raise ValueError(f'SFTDataset pad_id={pad_id!r} is not an id of '
                             f'the tokenizer; allowed: 0 to {vocab_size - 1}')
        self.context_length = context_length
        self.template = chosen_template(template, self.tokenizer)
        self.pad_id = pad_id
        self.samples = []
        for path in expand_files(files):
            for where, record in jsonl_records(path):
                messages = record_messages(record, where)
                self.samples.append(render(messages, self.tokenizer,
                                           self.template))
        self.pack = pack
        self.document_attention = document_attention
        self.windows = pack_records(
            [min(len(ids), context_length + 1) - 1
             for ids, _ in self.samples], context_length) if pack else None
        self.num_windows = num_windows
        self.truncate = truncate

    @property
    def metainfo(self) -> dict:
        return lm_metainfo(self.tokenizer, self.context_length)

    def __len__(self) -> int:
        total = len(self.windows) if self.pack else len(self.samples)
        return min(total, self.num_windows or total)

    def _record(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        return record_sample(*self.samples[idx], self.context_length,
                             self.truncate)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        # Unpacked, a sample is a window of one record.
        records = self.windows[idx] if self.pack else [idx]
        item = packed_window([self._record(i) for i in records],
                             self.context_length, self.pad_id)
        if not self.document_attention:
            del item['doc_ids']
        return {k: torch.from_numpy(v.astype(np.int64))
                for k, v in item.items()}
