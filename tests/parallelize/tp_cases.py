"""Shared pieces of the tensor-parallel tests: a tiny ViT, data, reference.

Parity uses SGD: AdamW divides by sqrt(v) and so amplifies float noise on
parameters whose gradient is analytically zero (3e-4 after 3 steps,
measured), which would hide real errors behind a loose tolerance.
"""
import copy

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     get_model_state_dict)

from mmpar.models.vit import DigitsViT
from tests.toy import make_optim_wrapper

ACCUMULATE = 2
STEPS = 3
CLIP = 0.05  # well below the gradient norm (about 1): clipping is active
LR = 0.1


def make_vit(seed: int = 0) -> DigitsViT:
    torch.manual_seed(seed)
    return DigitsViT(embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)


def make_splittable_vit(seed: int = 0):
    """The user model of examples/my_pkg/tp_vit.py (attention splits too)."""
    from examples.my_pkg.tp_vit import SplittableViT
    torch.manual_seed(seed)
    return SplittableViT(embed_dim=16, depth=2, num_heads=4)


def make_fused_vit(seed: int = 0):
    """The user model with timm's fused ``qkv`` attention."""
    from examples.my_pkg.tp_vit import SplittableViT
    torch.manual_seed(seed)
    return SplittableViT(embed_dim=16, depth=2, num_heads=4, fused_qkv=True)


MODELS = dict(vit=make_vit, splittable=make_splittable_vit,
              fused=make_fused_vit)


def make_image_batches(num=STEPS * ACCUMULATE, batch_size=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        dict(inputs=torch.randn(batch_size, 1, 8, 8, generator=gen),
             data_samples=torch.randint(0, 10, (batch_size, ), generator=gen))
        for _ in range(num)
    ]


def dp_slice(batch: dict, dp_rank: int, dp_size: int) -> dict:
    return {k: v.chunk(dp_size)[dp_rank] for k, v in batch.items()}


def optim_wrapper_for(model, amp: bool = False):
    """SGD, accumulation 2, clipping; ``amp``: mmpar's bf16 AmpOptimWrapper."""
    if not amp:
        return make_optim_wrapper(
            model, lr=LR, accumulative_counts=ACCUMULATE, clip=CLIP)
    from mmpar.optim import AmpOptimWrapper
    return AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        accumulative_counts=ACCUMULATE, clip_grad=dict(max_norm=CLIP))


def _train(step, optim_wrapper, batches) -> list:
    """Run ``step`` on each batch; the clip's total norm at each update."""
    norms = []
    for index, batch in enumerate(batches):
        step(batch, optim_wrapper)
        if (index + 1) % ACCUMULATE == 0:
            norms.append(optim_wrapper.message_hub.get_scalar(
                'train/grad_norm').current())
    assert min(norms) > CLIP, f'clipping inactive: grad norms {norms}'
    return norms


def reference_state(model, amp: bool = False):
    """One process, the global batches, accumulation and clipping.

    Returns:
        ``(state dict, [total grad norm at each optimizer step])``.
    """
    model = copy.deepcopy(model)
    norms = _train(model.train_step, optim_wrapper_for(model, amp),
                   make_image_batches())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, norms


def full_state(module) -> dict:
    """The plain model's state dict, gathered from any layout (collective)."""
    state = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def train_layout(wrapper, dp_rank: int, dp_size: int, amp: bool = False):
    """Train ``wrapper`` on this rank's slices.

    Returns:
        ``(full state dict, [total grad norm at each optimizer step])``.
    """
    batches = [dp_slice(b, dp_rank, dp_size) for b in make_image_batches()]
    norms = _train(wrapper.train_step,
                   optim_wrapper_for(wrapper.module, amp), batches)
    return dict(wrapper.full_state_dict()), norms


def assert_parity(actual, expected, initial: dict, rtol=1e-4,
                  atol=2e-7, norm_rtol=1e-5) -> None:
    """Same clip norms (1e-5 relative) and the same parameter *updates*.

    Comparing updates, not values, keeps the test sharp: parameters are
    O(0.1) while 3 clipped SGD steps move them by O(1e-3).
    """
    (state, norms), (ref_state, ref_norms) = actual, expected
    torch.testing.assert_close(norms, ref_norms, rtol=norm_rtol, atol=0)
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        torch.testing.assert_close(
            state[key] - initial[key], value - initial[key], rtol=rtol,
            atol=atol, msg=key)


def world_mesh(tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    dp = dist.get_world_size() // tp
    return init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp'))


def llama_plan_without_prepare() -> dict:
    """mmpar's Llama plan less its prepare_input entries: each column-split
    projection lays out (gathers) the block input itself."""
    from mmpar.models.llama import TP_PLAN
    return {k: v for k, v in TP_PLAN.items() if v != 'prepare_input'}


def explicit_llama_plan() -> dict:
    """The Llama plan with prepare_input written out: the attention's
    ``(x, cos, sin)`` with a layout for ``x`` only, and the MLP handed plain
    tensors (``use_local_output=True``)."""
    return dict(type='module_plan', plan={
        **llama_plan_without_prepare(),
        'layers.*.attn': dict(style='prepare_input',
                              input_layouts=('shard(1)', None, None),
                              desired_input_layouts=['replicate', None,
                                                     None]),
        'layers.*.mlp': dict(style='prepare_input', input_layouts='shard(1)',
                             use_local_output=True),
    })
