"""tools/verify.py as a user meets it: the shipped ViT config agrees at
DDP, FSDP1, FSDP2, tp=2 and pp=2; a user's own mistakes (their plan,
sampler, loss, model written here) are named at the right step and module,
against one process or a parallel reference (``--against dp_shard=2``).

The reference runs in this process, the layout on the shared gloo pool
(``run_dist``), through the same functions the tool calls; one launch of
``bash tools/dist_verify.sh`` checks the entry point and its exit status.
"""
import pytest
import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.dataset import DefaultSampler
from torch import nn
from torch.nn import functional as F

from mmpar.failures import ConfigError
from mmpar.models import DigitsViT
from mmpar.registry import DATA_SAMPLERS, MODELS
from mmpar.verify import check_options, run_layout, run_reference
from mmpar.verify.choose import choose_reference
from tests.e2e import ROOT, run_tool
from tests.verify.one_rank_fails import MESSAGE
from tests.trained import SMALL_MODEL

CONFIG = 'configs/vit_digits/vit_digits.py'
FSDP1 = 'configs/vit_digits/vit_digits_fsdp.py'
FSDP2 = 'configs/vit_digits/vit_digits_fsdp2.py'
TP = 'configs/vit_digits/vit_digits_tp.py'
PP = 'configs/vit_digits/vit_digits_pp.py'
TP_CUSTOM = 'configs/vit_digits/vit_digits_tp_custom.py'
STEPS = 2
TOL = dict(rtol=1e-3, atol=1e-7)


# -- the user's code ----------------------------------------------------------
@DATA_SAMPLERS.register_module(force=True)
class SameOnEveryRankSampler(DefaultSampler):
    """A user's sampler that shuffles but forgets to split by data rank."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=gen).tolist()
        return iter(order[:self.num_samples])


class Calibrate(nn.Module):
    """A user's running shift, updated on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.register_buffer('shift', torch.zeros(()))

    def forward(self, x):
        out = x - self.shift
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if self.training and rank0:
            with torch.no_grad():
                self.shift += 0.5 * x.mean()
        return out


@MODELS.register_module(force=True)
class CalibratedViT(DigitsViT):
    """The digits ViT behind the user's :class:`Calibrate`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calib = Calibrate()

    def pipeline_embed(self, inputs):
        return super().pipeline_embed(self.calib(inputs))


class RankSeededDropout(nn.Module):
    """A user's token dropout drawing from its own generator, seeded from
    the rank: tensor-parallel replicas of one activation drop different
    tokens."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.gen = None

    def forward(self, x):
        if not self.training:
            return x
        if self.gen is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.gen = torch.Generator().manual_seed(1000 + rank)
        keep = torch.rand(x.shape[:-1], generator=self.gen) >= self.p
        return x * keep.unsqueeze(-1) / (1 - self.p)


@MODELS.register_module(force=True)
class DroppingViT(DigitsViT):
    """The digits ViT with torch's dropout (the default generator: the same
    draws at both layouts), then the user's :class:`RankSeededDropout`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = nn.Dropout(0.1)
        self.token_drop = RankSeededDropout(0.1)

    def pipeline_embed(self, inputs):
        return self.token_drop(self.drop(super().pipeline_embed(inputs)))


@MODELS.register_module(force=True)
class UnlabelledViT(DigitsViT):
    """A user's digits ViT where class 0 is "unlabelled" (not counted): the
    loss is a mean over the counted samples of this rank's batch, which
    differs from the mean over the global batch when ranks count
    differently. ``count=True`` returns the count (``num_tokens``) too, so
    that mmpar normalises by the count over all ranks."""

    def __init__(self, count: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.count = count

    def pipeline_loss(self, logits, data_samples):
        targets = data_samples.masked_fill(data_samples == 0, -100)
        out = dict(loss=F.cross_entropy(logits, targets, ignore_index=-100))
        if self.count:
            out['num_tokens'] = (targets != -100).sum().float()
        return out


# -- helpers ------------------------------------------------------------------
def user_cfg(config, **updates):
    cfg = Config.fromfile(str(ROOT / config))
    cfg.model.update(SMALL_MODEL)
    cfg.update(updates)
    return cfg


def _layout(config, updates, work_dir, against='one-process'):
    cfg = user_cfg(config, **updates)
    cfg.launcher = 'pytorch'
    verdict = run_layout(cfg, work_dir, STEPS, **TOL, against=against)
    return None if verdict is None else (verdict.agree, verdict.text)


def _parallel_reference(config, work_dir, against):
    cfg = user_cfg(config)
    cfg.launcher = 'pytorch'
    return run_reference(cfg, work_dir, STEPS, 2, against)


def verify(run_dist, config, work_dir, reference=True, against=None,
           **updates):
    """The verdict's (agree, text) from rank 0; against a parallel
    reference (at 2 ranks) when ``against`` is given."""
    if reference and against is None:
        run_reference(user_cfg(config, **updates), str(work_dir), STEPS, 2)
    elif reference:
        run_dist(_parallel_reference, config, str(work_dir), against)
    results = run_dist(_layout, config, updates, str(work_dir),
                       against or 'one-process')
    return results[0]


# -- agree ----------------------------------------------------------------------
def test_shipped_layouts_agree(run_dist, tmp_path):
    # DDP and FSDP2 at 2 ranks read the same global batch: one reference.
    run_reference(user_cfg(CONFIG), str(tmp_path), STEPS, 2)
    agree, text = verify(run_dist, CONFIG, tmp_path, reference=False)
    assert agree, text
    assert f'all {STEPS} steps agree (max relative difference' in text, text
    assert 'rtol 0.001, atol 1e-07' in text, text
    agree, text = verify(run_dist, FSDP2, tmp_path, reference=False)
    assert agree, text
    # FSDP1's gradients are views of flat shards: verify shows them whole.
    agree, text = verify(run_dist, FSDP1, tmp_path, reference=False)
    assert agree, text
    agree, text = verify(run_dist, TP, tmp_path / 'tp')
    assert agree, text


def test_pipeline_agrees(run_dist, tmp_path):
    # torch's stages run once more at the first step to infer shapes; that
    # call is no micro-batch of the reference and is not counted.
    # The small model has 2 blocks: the split moves to the second.
    pipeline = dict(split_points=['blocks.1'], schedule='1F1B',
                    num_microbatches=4)
    agree, text = verify(run_dist, PP, tmp_path,
                         parallel=dict(pp=2, pipeline=pipeline))
    assert agree, text
    # The first stage's own output (the root's name: the reference has no
    # tensor output there to compare it with) holds the same rows at every
    # step: torch's extra call is not counted there either.
    steps = torch.load(tmp_path / 'layout.pt', weights_only=False)['steps']
    assert [step['outputs'][''][0][1] for step in steps] == [
        steps[-1]['outputs'][''][0][1]] * STEPS


def test_pipeline_with_gradient_accumulation_agrees(run_dist, tmp_path):
    # Two batches a step: the stages' shape-inference call comes once, in
    # the first batch; the first step runs 2 x 4 micro-batches besides it.
    pipeline = dict(split_points=['blocks.1'], schedule='1F1B',
                    num_microbatches=4)
    agree, text = verify(run_dist, PP, tmp_path,
                         parallel=dict(pp=2, pipeline=pipeline),
                         optim_wrapper=dict(accumulative_counts=2))
    assert agree, text
    assert f'all {STEPS} steps agree' in text, text


# -- planted faults -------------------------------------------------------------
def test_swapped_plan_styles_named_at_the_module(run_dist, tmp_path):
    cfg = Config.fromfile(str(ROOT / TP_CUSTOM))
    plan = dict(cfg.parallel.tp_plan.plan)
    plan['blocks.*.mlp.fc1'], plan['blocks.*.mlp.fc2'] = 'rowwise', 'colwise'
    parallel = dict(tp=2, tp_plan=dict(type='module_plan', plan=plan))
    agree, text = verify(run_dist, TP_CUSTOM, tmp_path, parallel=parallel)
    assert not agree
    assert 'step 0' in text and '`blocks.0.mlp.fc1`' in text, text
    assert "tp: rowwise plan on 'blocks.*.mlp.fc1'" in text, text


def test_sampler_ignoring_the_data_rank_named_at_the_first_module(
        run_dist, tmp_path):
    sampler = dict(type='SameOnEveryRankSampler', shuffle=True)
    agree, text = verify(run_dist, CONFIG, tmp_path,
                         train_dataloader=dict(sampler=sampler))
    assert not agree
    assert 'step 0 differs first at module `data_preprocessor`' in text, text


def test_buffer_updated_on_one_rank_named_at_its_step_and_module(
        run_dist, tmp_path):
    model = dict(type='CalibratedViT')
    agree, text = verify(run_dist, CONFIG, tmp_path, model=model)
    assert not agree
    assert 'step 0: ' in text and 'agree' in text.splitlines()[0], text
    assert 'step 1 differs first at module `calib`' in text, text


def test_rank_seeded_dropout_named_at_its_module(run_dist, tmp_path):
    # torch's own dropout (module `drop`) runs first and agrees at tp=2;
    # the user's generator seeded from the rank is the first to differ.
    agree, text = verify(run_dist, TP, tmp_path,
                         model=dict(type='DroppingViT'))
    assert not agree
    assert 'step 0 differs first at module `token_drop`' in text, text
    assert '`drop`' in text.splitlines()[1], text


def test_loss_averaged_per_rank_named_at_the_head_gradient(run_dist,
                                                           tmp_path):
    # Every module output agrees. The loss moves by about 1e-4 only (at the
    # start every sample's loss is near ln 10, however they are weighed);
    # the gradient the loss sends back is the first beyond tolerance, at the
    # head, the first module in backward order.
    agree, text = verify(run_dist, CONFIG, tmp_path,
                         model=dict(type='UnlabelledViT'))
    assert not agree
    assert 'step 0 differs first at module `head` (gradient of' in text, text
    assert '(the loss within ' in text and '`norm`, `head`' in text, text
    # The same loss with its count: mmpar averages over the global count.
    agree, text = verify(run_dist, CONFIG, tmp_path / 'counted',
                         model=dict(type='UnlabelledViT', count=True))
    assert agree, text


def test_fused_qkv_split_as_plain_colwise_named_against_dp_shard_2(
        run_dist, tmp_path):
    # The user's timm-style attention (one qkv Linear, rows [q; k; v]) split
    # by a plain colwise plan, not a fused one: rank 0 holds q and half of
    # k as "its q, k, v". The gathered qkv output is the reference's; the
    # attention's output, `proj`, is the first to differ. The fused plan
    # agrees, against the same data-parallel reference (2 ranks, DDP).
    plans = {}
    for name, qkv in (('plain', "'colwise'"),
                      ('fused', "dict(style='colwise', fused=3)")):
        plans[name] = tmp_path / f'{name}.py'
        plans[name].write_text(
            f"_base_ = [{str(ROOT / TP_CUSTOM)!r}]\n"
            "model = dict(fused_qkv=True)\n"
            "parallel = dict(tp_plan=dict(plan=dict(_delete_=True, **{\n"
            "    'blocks.*.attn': 'prepare_input',\n"
            f"    'blocks.*.attn.qkv': {qkv},\n"
            "    'blocks.*.attn.proj': 'rowwise',\n"
            "    'blocks.*.mlp.fc1': 'colwise',\n"
            "    'blocks.*.mlp.fc2': 'rowwise'})))\n")
    against = 'dp_shard=2'
    agree, text = verify(run_dist, plans['plain'], tmp_path, against=against)
    assert not agree
    assert 'step 0 differs first at module `blocks.0.attn.proj` (output)' \
        in text, text
    assert '`blocks.0.attn.qkv`' in text.splitlines()[1], text
    assert "tp: rowwise plan on 'blocks.*.attn.proj'" in text, text
    assert '(dp_shard=2 at 2 ranks)' in text, text
    agree, text = verify(run_dist, plans['fused'], tmp_path, reference=False,
                         against=against)
    assert agree, text


def test_dist_verify_names_a_swapped_plan_and_exits_1(tmp_path):
    # The user's config: their plan with fc1 and fc2's styles swapped.
    config = tmp_path / 'my_tp.py'
    config.write_text(
        f"_base_ = [{str(ROOT / TP_CUSTOM)!r}]\n"
        "parallel = dict(tp_plan=dict(plan={'blocks.*.mlp.fc1': 'rowwise', "
        "'blocks.*.mlp.fc2': 'colwise'}))\n")
    work_dir = tmp_path / 'verify'
    tool = ['bash', 'tools/dist_verify.sh', config, 2, '--steps', 1,
            '--work-dir', work_dir]
    # A reference layout the global batch (32) does not split over: refused
    # before anything trains.
    proc = run_tool(tool + ['--against', 'dp_shard=3'], check=False)
    assert proc.returncode != 0
    assert "--against='dp_shard=3': the global batch of 32 samples" in \
        proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert not work_dir.exists()
    # Against a data-parallel reference, launched on its own 2 ranks.
    proc = run_tool(tool + ['--against', 'dp_shard=2'], check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'step 0: the layout failed in module `blocks.0.mlp.fc1`' in \
        proc.stdout, proc.stdout[-3000:]
    assert "tp: rowwise plan on 'blocks.*.mlp.fc1'" in proc.stdout
    assert '(dp_shard=2 at 2 ranks)' in proc.stdout, proc.stdout[-3000:]


def test_dist_verify_ends_when_the_layout_fails_on_one_rank(tmp_path):
    # Rank 1 raises in its forward while rank 0 waits in DDP's gradient
    # all-reduce: the job must end with rank 1's report, not wait out the
    # collective timeout (30 minutes here; the tool's limit is 5).
    config = tmp_path / 'mine.py'
    config.write_text(
        f"_base_ = [{str(ROOT / CONFIG)!r}]\n"
        "custom_imports = dict(imports=['tests.verify.one_rank_fails'], "
        "allow_failed_imports=False)\n"
        "model = dict(type='ViTFailingOnOneRank')\n"
        "env_cfg = dict(dist_cfg=dict(timeout=1800))\n")
    work_dir = tmp_path / 'verify'
    proc = run_tool(['bash', 'tools/dist_verify.sh', config, 2, '--steps',
                     2, '--work-dir', work_dir], check=False, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    named = (f'step 0: the layout failed in module `head`: RuntimeError: '
             f'{MESSAGE}')
    assert named in proc.stdout, proc.stdout[-3000:]
    assert named in (work_dir / 'report.txt').read_text()


# -- options --------------------------------------------------------------------
@pytest.mark.parametrize('steps,rtol,atol,against,named', [
    (0, 1e-3, 0.0, 'one-process', '--steps=0'),
    (2, -1.0, 0.0, 'one-process', '--rtol=-1.0'),
    (2, 1e-3, float('nan'), 'one-process', '--atol=nan'),
    (2, 1e-3, 0.0, 'tp=2', "--against='tp=2': a tensor-parallel reference"),
    (2, 1e-3, 0.0, 'dp_shard=1', "--against='dp_shard=1': 1 rank"),
    (2, 1e-3, 0.0, 'dp=x', "--against='dp=x': unknown axis 'dp'"),
    (2, 1e-3, 0.0, 'pp=two', "--against='pp=two': pp=two is not an int"),
])
def test_bad_options_name_the_option(steps, rtol, atol, against, named):
    with pytest.raises(ConfigError, match='allowed') as err:
        check_options(steps, rtol, atol, against)
    assert named in str(err.value)
