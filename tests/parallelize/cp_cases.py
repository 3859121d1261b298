"""Context-parallel training runs and their one-process oracle (module
level: spawned workers unpickle them).

The oracle is written out here, not taken from a step body: per optimizer
step, the cross-entropy summed over every counted token of the window's
micro-batches, divided by their number, one backward, the global-norm clip,
SGD with momentum (what ``tests.toy.make_optim_wrapper`` builds).
"""
import copy

import torch
import torch.nn.functional as F

IGNORE = -100
VOCAB, SEQ = 64, 16
ACCUMULATE = 2
OPTIM = dict(lr=0.1, accumulative_counts=ACCUMULATE, clip=0.05)


def make_llama(seed: int = 0):
    from mmpar.models.llama import Llama
    torch.manual_seed(seed)
    return Llama(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=SEQ)


def make_lm_batches(num: int = 4, batch_size: int = 4, masked: bool = True,
                    seed: int = 1) -> list:
    """Global batches ``dict(inputs, data_samples)``; ``masked``: targets
    left out unevenly (a prompt on one sample, a padded tail on another, a
    whole sample in one batch), so ranks, chunks and micro-batches count
    different numbers of tokens."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(num):
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
        targets = tokens[:, 1:].clone()
        if masked:
            targets[0, :5] = IGNORE  # a prompt
            targets[-1, 11 + index % 3:] = IGNORE  # padding
            if index == 1:
                targets[1] = IGNORE  # nothing counted in one sample
        batches.append(dict(inputs=tokens[:, :-1], data_samples=targets))
    return batches


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=OPTIM['lr'], momentum=0.9)


def reference(model, batches) -> tuple:
    """One process on the global batches: ``(state, logged losses, gradient
    norms)``, the loss of each micro-batch its mean over its counted tokens,
    the norm of each step's gradient before clipping (clipping takes out a
    uniform scale of the gradient: the norm shows it)."""
    model = copy.deepcopy(model)
    optimizer = _sgd(model)
    losses, norms = [], []
    for start in range(0, len(batches), ACCUMULATE):
        window = batches[start:start + ACCUMULATE]
        count = sum(int((b['data_samples'] != IGNORE).sum()) for b in window)
        optimizer.zero_grad()
        total = 0
        for batch in window:
            logits = model(batch['inputs'])
            loss_sum = F.cross_entropy(logits.flatten(0, 1),
                                       batch['data_samples'].flatten(),
                                       ignore_index=IGNORE, reduction='sum')
            counted = int((batch['data_samples'] != IGNORE).sum())
            losses.append(float(loss_sum.detach()) / max(counted, 1))
            total = total + loss_sum
        (total / count).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                              OPTIM['clip'])
        assert norm > 2 * OPTIM['clip']  # the clip is active
        norms.append(float(norm))
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, \
        losses, norms


def dp_slice(batch: dict, rank: int, size: int) -> dict:
    """This data rank's contiguous share of a global batch."""
    return {k: v.chunk(size)[rank] for k, v in batch.items()}


def train_cp(parallel: dict, wrapper_cfg, batches) -> tuple:
    """Train through ``parallelize`` on this rank: ``(plain-named state,
    logged losses, gradient norms, (dp rank, cp rank))``."""
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    from mmpar.wrappers import describe
    from tests.toy import make_optim_wrapper
    topology = setup_parallelism(parallel, wrapper_cfg)  # reset by harness
    model = parallelize(make_llama(), topology, parallel, wrapper_cfg)
    optim_wrapper = make_optim_wrapper(model, **OPTIM)
    losses, norms = [], []
    for index, batch in enumerate(batches):
        log_vars = model.train_step(
            dp_slice(batch, topology.dp_rank, topology.dp_size),
            optim_wrapper)
        losses.append(float(log_vars['loss']))
        if (index + 1) % ACCUMULATE == 0:  # stepped: the norm it clipped
            norms.append(optim_wrapper.message_hub.get_scalar(
                f'train/{optim_wrapper.grad_name}').current())
    if describe(model).pipeline is not None:
        from tests.parallelize.pipeline_cases import stage_state
        state = stage_state(model)
    else:
        state = {k: v.detach().clone()
                 for k, v in model.full_state_dict().items()}
    return state, losses, norms, (topology.dp_rank, topology.cp.rank)
