"""Chats rendered by a Hugging Face tokenizer's chat template, with the
assistant tokens found.

The template (``tokenizer.chat_template``, Jinja) renders a whole chat to
one string, which is tokenized once. The answer spans are found by
rendering prefixes of the chat: an assistant message ``k`` spans from the
end of ``messages[:k]`` rendered with ``add_generation_prompt=True`` (the
prompt up to and including the assistant header) to the end of
``messages[:k + 1]`` rendered (its content and end-of-turn marks, so the
model learns to stop). A token counts as an answer token when its first
character (the tokenizer's offsets) lies in such a span, so merges of
tokens across the boundary cannot shift a count.

This works with any template whose rendering of a chat's prefix is a
prefix of the rendering of the whole chat, which is checked: a template
that rewrites earlier turns (e.g. one dropping past reasoning) is refused
rather than masked wrongly. transformers' ``return_assistant_tokens_mask``
is not used: it needs ``{% generation %}`` marks, which most shipped
templates (Llama 3, Mistral, Qwen) lack.
"""
from typing import List, Sequence, Tuple

import numpy as np

ANSWER_ROLE = 'assistant'


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` is an :class:`~mmpar.datasets.HFTokenizer`
    whose Hugging Face tokenizer has a chat template."""
    hf = getattr(tokenizer, 'tokenizer', None)
    return bool(getattr(hf, 'chat_template', None))


def _rendered(hf, messages: Sequence[dict], generation: bool) -> str:
    if not messages and not generation:
        return ''
    return hf.apply_chat_template(list(messages), tokenize=False,
                                  add_generation_prompt=generation)


def answer_spans(hf, messages: Sequence[dict]
                 ) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered chat and its assistant spans ``[(begin, end), ...]`` in
    characters.

    Raises:
        ValueError: a template that does not render a chat's prefix as a
            prefix of the whole.
    """
    text = _rendered(hf, messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message['role'] != ANSWER_ROLE:
            continue
        prompt = _rendered(hf, messages[:k], True)
        upto = _rendered(hf, messages[:k + 1], False)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise ValueError(
                'template=\'hf\': the chat template does not render a chat\'s '
                f'first {k} messages (+ generation prompt) and first {k + 1} '
                'as prefixes of the whole chat, so the answer tokens cannot '
                'be found; allowed: such a template, or template=None / a '
                'dict of format strings')
        spans.append((len(prompt), len(upto)))
    return text, spans


def render_chat(messages: Sequence[dict],
                tokenizer) -> Tuple[np.ndarray, np.ndarray]:
    """``(token ids, is_answer)`` of a chat rendered by ``tokenizer``'s
    (an :class:`~mmpar.datasets.HFTokenizer`) chat template."""
    hf = tokenizer.tokenizer
    text, spans = answer_spans(hf, messages)
    encoded = hf(text, add_special_tokens=False,
                 return_offsets_mapping=True)
    starts = np.asarray([b for b, _ in encoded['offset_mapping']], np.int64)
    answer = np.zeros(len(starts), bool)
    for begin, end in spans:
        answer |= (starts >= begin) & (starts < end)
    return np.asarray(encoded['input_ids'], np.int64), answer
