"""The plan at cp > 1: cp and gradient (dp x cp) groups, the wrapper's
reduction over dp x cp, this rank's chunks and equal attention work per cp
rank; a model without the protocol is refused as training refuses it."""
import pytest
from mmengine.config import Config

from mmpar.analysis.fsdp_units import PlanError
from mmpar.analysis.plan import make_plan
from mmpar.analysis.plan_report import format_plan

CP_CONFIG = 'configs/llama_shakespeare/llama_shakespeare_cp.py'


def _plan(path, world_size, rank, **options):
    cfg = Config.fromfile(path)
    cfg.merge_from_dict(options)
    return make_plan(cfg, world_size, rank)


def test_cp_plan_groups_axes_and_chunks():
    plan = _plan(CP_CONFIG, 8, 5)  # cp=2 x dp_shard=4, FSDP2
    assert (plan.dims.dp, plan.dims.cp) == (4, 2)
    # FSDP2 shards over dp_shard x cp: cp peers hold different shards.
    assert plan.axes == {'shard': ('dp_cp', list(range(8)))}
    text = format_plan(plan)
    assert 'cp groups: [0, 1] [2, 3] [4, 5] [6, 7]' in text
    assert 'gradients over dp_cp = dp x cp = 8' in text
    assert 'cp rank 1 (this rank) holds chunks 1 and 2' in text
    assert 'this rank holds positions 256..511 and 512..767 (512 tokens); ' \
        'attention scores per (sample, head) and cp rank [327680, ' \
        '327680] (equal)' in text


def test_cp_plan_ddp_reduces_over_dp_x_cp():
    plan = _plan('configs/llama_shakespeare/llama_shakespeare.py', 4, 2,
                 **{'parallel.cp': 2})
    assert plan.axes == {'reduce': ('dp_cp', [0, 1, 2, 3])}
    assert 'cp groups' not in format_plan(_plan(
        'configs/llama_shakespeare/llama_shakespeare.py', 4, 2))


def test_cp_plan_refuses_a_model_without_the_protocol():
    with pytest.raises(PlanError, match=r"parallel.cp=2 is not allowed; "
                       r"model.type='DigitsViT' has no context-parallel"):
        _plan('configs/vit_digits/vit_digits_iter.py', 2, 0,
              **{'parallel.cp': 2})

