"""Fused projections under tensor parallelism (docs/tensor_parallel.md).

timm's attention computes q, k and v with one ``qkv`` Linear (rows
``[q; k; v]``). ``dict(style='colwise', fused=3)`` splits each part on its
own: the tp=2 model trains like one process and gathers to the plain
model's weights. A plan that splits it plainly under timm's code (head count
from ``self.num_heads``) is refused at the first call, naming ``qkv`` and the
style, on every rank, by the meta dry run (:mod:`mmpar.parallelize.tp_check`)
instead of failing deep inside the model.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mmpar.failures import ConfigError
from mmpar.parallelize.module_plan import module_plan_styles
from mmpar.parallelize.tensor import apply_tp, check_tp_plan
from mmpar.wrappers.tp_replicate import MMTensorParallelDDP
from tests.parallelize import tp_cases


make_fused_vit = tp_cases.make_fused_vit


def fused_plan(qkv='fused') -> dict:
    from examples.my_pkg.tp_vit import FUSED_TP_PLAN
    plan = dict(FUSED_TP_PLAN)
    if qkv != 'fused':
        plan['blocks.*.attn.qkv'] = qkv
    return dict(type='module_plan', plan=plan)


def timm_forward(self, x):
    """timm's Attention.forward as written: heads from ``self.num_heads``."""
    batch, length, dim = x.shape
    qkv = self.qkv(x).reshape(batch, length, 3, self.num_heads,
                              self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    out = F.scaled_dot_product_attention(q, k, v)
    return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


# -- the entry, checked without a process group ------------------------------
@pytest.mark.parametrize('fused, match', [
    (0, r"'blocks.\*.attn.qkv'\]\.fused=0 is not allowed; allowed: an int"),
    (True, r'fused=True is not allowed'),
])
def test_bad_fused_value_named(fused, match):
    plan = {'blocks.*.attn.qkv': dict(style='colwise', fused=fused)}
    with pytest.raises(ValueError, match=match):
        check_tp_plan(dict(type='module_plan', plan=plan))


def test_fused_takes_no_sharded_output_and_is_colwise_only():
    with pytest.raises(ValueError, match=(
            r"output_layouts='shard\(1\)' is not allowed with fused; "
            r"allowed: None .* 'replicate'")):
        check_tp_plan(dict(type='module_plan', plan={'a': dict(
            style='colwise', fused=3, output_layouts='shard(1)')}))
    with pytest.raises(ValueError, match=r"style 'rowwise' takes no fused"):
        check_tp_plan(dict(type='module_plan', plan={'a': dict(
            style='rowwise', fused=3)}))


def test_tp_times_fused_must_divide_the_rows():
    # qkv: 48 rows = 3 parts of 16; tp=32 divides 48... not 16 per part.
    plan = {'blocks.*.attn.qkv': dict(style='colwise', fused=3)}
    with pytest.raises(ValueError, match=r"tp=32 x fused=3 does not divide "
                       r"'blocks.0.attn.qkv'.*size 48"):
        module_plan_styles(make_fused_vit(), plan, 32)


# -- tp=2 against one process ------------------------------------------------
def _fused_parity():
    mesh = tp_cases.world_mesh(2)
    model = make_fused_vit()
    initial = tp_cases.full_state(model)
    expected = tp_cases.reference_state(model)
    apply_tp(model, mesh['tp'], fused_plan())
    qkv = model.blocks[0].attn.qkv.weight
    assert isinstance(qkv, DTensor)
    # Rank r holds [q_r; k_r; v_r]: half of each 16-row part.
    whole = initial['blocks.0.attn.qkv.weight']
    rank = mesh['tp'].get_local_rank()
    torch.testing.assert_close(qkv.to_local(), torch.cat(
        [part.chunk(2)[rank] for part in whole.chunk(3)]))
    wrapper = MMTensorParallelDDP(model, process_group=mesh['dp'].get_group())
    actual = tp_cases.train_layout(wrapper, 0, 1)
    tp_cases.assert_parity(actual, expected, initial)
    make_fused_vit().load_state_dict(actual[0], strict=True)
    return dist.get_rank()


def test_fused_qkv_tp2_trains_like_one_process(run_dist):
    assert run_dist(_fused_parity) == [0, 1]


def _fsdp2_refused():
    from mmpar.wrappers.fully_shard import MMFullyShard
    mesh = tp_cases.world_mesh(2)
    model = make_fused_vit()
    apply_tp(model, mesh['tp'], fused_plan(), dry_run=False)
    try:
        MMFullyShard(model, device_mesh=mesh['dp'])
    except ConfigError as err:
        return str(err)
    return None


def test_fsdp2_over_a_fused_split_is_refused(run_dist):
    """fully_shard reads the strided tp parts as Shard(0) and gathers them
    in the wrong order (measured: qkv differs from one process's after a
    step); refused when the wrapper is built, naming the parameters."""
    for message in run_dist(_fsdp2_refused):
        assert message is not None and message.startswith(
            "model_wrapper_cfg.type='MMFullyShard' cannot shard the fused "
            "tp parameters ['blocks.0.attn.qkv.weight', "), message
        assert "allowed: model_wrapper_cfg.type='MMDistributedDataParallel'" \
            in message


def _first_call_refused(qkv, forward):
    from examples.my_pkg.tp_vit import FusedQKVAttention
    mesh = tp_cases.world_mesh(2)
    model = make_fused_vit()
    if forward == 'timm':
        for block in model.blocks:
            block.attn.forward = timm_forward.__get__(block.attn,
                                                      FusedQKVAttention)
    apply_tp(model, mesh['tp'], fused_plan(qkv))
    batch = tp_cases.make_image_batches(1)[0]
    try:
        model(**batch, mode='loss')
    except ConfigError as err:
        return str(err)
    return None


def test_plain_colwise_on_timm_qkv_is_refused_naming_qkv(run_dist):
    messages = run_dist(_first_call_refused, 'colwise', 'timm')
    for message in messages:
        assert message is not None
        assert message.startswith('parallel.tp_plan: the split model cannot '
                                  "run: its forward (dry-run on the meta "
                                  "device at the first call) fails in "
                                  "'blocks.0.attn' after 'blocks.0.attn.qkv'"
                                  " (style 'colwise') returned"), message
        assert 'RuntimeError' in message and 'is invalid' in message
        assert "dict(style='colwise', fused=3)" in message


def _sharded_save_refused(directory):
    from mmpar.checkpoint.sharded import save_sharded
    mesh = tp_cases.world_mesh(2)
    model = make_fused_vit()
    apply_tp(model, mesh['tp'], fused_plan(), dry_run=False)
    try:
        save_sharded(model, None, f'{directory}/ckpt', {},
                     save_optimizer=False)
    except ConfigError as err:
        return str(err)
    return None


def test_sharded_checkpoint_of_a_fused_split_is_refused(run_dist, tmp_path):
    """DCP sees the strided parts as overlapping chunks; a plan the config
    check cannot read (e.g. 'hf' with packed_colwise) is refused at the
    save, naming the key and the parameters."""
    for message in run_dist(_sharded_save_refused, str(tmp_path)):
        assert message is not None and message.startswith(
            "checkpoint_format='sharded' cannot store the fused tp "
            "parameters ['blocks.0.attn.qkv.weight', "), message
