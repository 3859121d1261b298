"""Building on the meta device: the weights equal a one-process build from
the same seed, bit for bit, in every sharding layout, and a rank allocates
only its share."""
import copy

import pytest
import torch
import torch.distributed as dist
from mmengine.model import BaseModule
from torch import nn

from mmpar.failures import ConfigError
from mmpar.parallelize.meta import build_on_meta
from mmpar.registry import MODELS

LLAMA = dict(type='Llama', vocab_size=64, dim=32, num_layers=4, num_heads=4,
             max_seq_len=16)
HF = dict(type='HFCausalLM', config=dict(
    model_type='llama', vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=16))


class InitCfgNet(BaseModule):
    """MMEngine's init_cfg initialisers, a padding row, trunc_normal_ and
    orthogonal_ (which skip meta tensors in torch), a zeros token nothing
    re-initialises and a buffer."""

    def __init__(self):
        super().__init__(init_cfg=[
            dict(type='Kaiming', layer='Conv2d'),
            dict(type='Normal', layer='Linear', std=0.1, bias=0.5)])
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 5)
        self.embed = nn.Embedding(10, 4, padding_idx=2)
        self.token = nn.Parameter(torch.zeros(1, 4))
        self.pos = nn.Parameter(torch.empty(3, 4))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.norm = nn.BatchNorm1d(4)
        self.rotate = nn.Linear(4, 4, bias=False)
        nn.init.orthogonal_(self.rotate.weight)  # QR of a normal draw
        self.register_buffer('table', torch.arange(6.).reshape(2, 3))


class ReadsParameters(nn.Module):
    """Initialises one parameter from another's value: not replayable."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight * 2)


def _one_process(build, seed=3):
    torch.manual_seed(seed)
    model = build()
    if hasattr(model, 'init_weights'):
        model.init_weights()
    return model, torch.rand(4)  # where the generator stands after


def _on_meta(build, seed=3):
    torch.manual_seed(seed)
    model, init = build_on_meta(build)
    after = torch.rand(4)
    assert all(p.is_meta for p in model.parameters())
    init.materialize(model, torch.device('cpu'))
    return model, after


@pytest.mark.parametrize('build', [
    lambda: MODELS.build(copy.deepcopy(LLAMA)),
    lambda: MODELS.build(dict(LLAMA, tie_embeddings=True)),
    lambda: MODELS.build(dict(type='DigitsViT')),
    lambda: MODELS.build(copy.deepcopy(HF)),
    InitCfgNet,
], ids=['llama', 'llama_tied', 'vit', 'hf', 'init_cfg'])
def test_meta_build_equals_one_process_bit_for_bit(build):
    expected, after_expected = _one_process(build)
    model, after = _on_meta(build)
    # The generator advanced exactly as a whole build advances it.
    assert torch.equal(after, after_expected)
    want, got = expected.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_meta_build_differs_for_another_seed():
    # (So the equality above is not equal-by-default.)
    build = lambda: MODELS.build(copy.deepcopy(LLAMA))  # noqa: E731
    expected, _ = _one_process(build, seed=3)
    model, _ = _on_meta(build, seed=4)
    assert not torch.equal(expected.state_dict()['output.weight'],
                           model.state_dict()['output.weight'])


def test_another_threads_modules_are_built_as_torch_builds_them():
    """A thread that makes a module while the model is built on meta (a
    data-loader or logging thread) gets real parameters: the build's
    recording is this thread's only."""
    import threading
    made = {}

    def other_thread():
        made['layer'] = nn.Linear(3, 2)

    def build():
        model = nn.Linear(4, 4)
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        return model

    model, _ = build_on_meta(build, init_weights=False)
    assert not made['layer'].weight.is_meta
    assert made['layer'].weight.abs().sum() > 0  # initialised, not recorded
    assert model.weight.shape == (4, 4)


def test_a_model_that_reads_parameters_is_refused_naming_the_switch():
    model, init = build_on_meta(ReadsParameters)
    with pytest.raises(ConfigError, match=r"'b.weight'.*meta_init=False"):
        init.materialize(model, torch.device('cpu'))


def test_a_constructor_that_fails_on_meta_is_refused_naming_the_switch():

    class NeedsValues(nn.Module):

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            if self.w.sum().item() != 3:  # a value read on the meta device
                raise AssertionError

    with pytest.raises(ConfigError, match='cannot be built on the meta '
                       r'device .*allowed: set meta_init=False'):
        build_on_meta(NeedsValues)


def test_a_model_that_cannot_be_built_at_all_is_not_blamed_on_meta():

    class BadConfig(nn.Module):

        def __init__(self, depth=-1):
            super().__init__()
            if depth < 0:
                raise ValueError(f'depth={depth} must be >= 0')

    with pytest.raises(ConfigError) as info:
        build_on_meta(BadConfig)
    message = str(info.value)
    assert 'the model cannot be built (ValueError: depth=-1 must be ' \
        '>= 0); check the model section' in message
    assert 'allowed: set meta_init=False' not in message


class DrawsInInitWeights(InitCfgNet):
    """init_weights draws (init_cfg initialisers, then trunc_normal_ on a
    constructor-initialised parameter and a part of another)."""

    def init_weights(self):
        super().init_weights()
        nn.init.trunc_normal_(self.rotate.weight, std=0.5)
        with torch.no_grad():
            self.pos[1].normal_()


def test_init_weights_recorded_later_sees_the_generator_of_that_moment():
    """The Runner's order: build, other draws (a data-loader seed), then
    init_weights; recorded on a copy of the meta model, it gives one
    process's weights and generator."""
    torch.manual_seed(3)
    expected = DrawsInInitWeights()
    torch.rand(2)  # the loop's draw
    expected.init_weights()
    after_expected = torch.rand(4)

    torch.manual_seed(3)
    model, init = build_on_meta(DrawsInInitWeights, init_weights=False)
    torch.rand(2)
    changed = init.record_init_weights(copy.deepcopy(model))
    after = torch.rand(4)
    assert torch.equal(after, after_expected)
    assert set(changed) == {'conv.weight', 'conv.bias', 'fc.weight',
                            'fc.bias', 'rotate.weight', 'pos'}
    for name, param in expected.named_parameters():
        assert torch.equal(init.value(name), param.detach()), name


def test_init_weights_that_fails_on_meta_is_refused_naming_the_switch():

    class ReadsInInit(nn.Linear):

        def init_weights(self):
            if self.weight.sum().item() > 0:  # a value read on meta
                pass

    model, init = build_on_meta(lambda: ReadsInInit(2, 2),
                                init_weights=False)
    with pytest.raises(ConfigError, match=r'init_weights.*meta_init=False'):
        init.record_init_weights(copy.deepcopy(model))


# -- every sharding layout, through compose ----------------------------------
LAYOUTS = {
    'fsdp2': (2, None, dict(type='MMFullyShard')),
    'fsdp1': (2, None, dict(type='MMFullyShardedDataParallel',
                            fsdp_auto_wrap_policy=dict(
                                type='module_class',
                                module_classes=['LlamaBlock']))),
    'tp2': (2, dict(tp=2, tp_plan='llama'), None),
    'tp2_fsdp2': (4, dict(tp=2, tp_plan='llama'), dict(type='MMFullyShard')),
    'pp2': (2, dict(pp=2, pipeline=dict(schedule='1F1B',
                                        num_microbatches=2)), None),
    'pp2_fsdp2': (4, dict(pp=2, pipeline=dict(schedule='1F1B',
                                              num_microbatches=2)),
                  dict(type='MMFullyShard')),
}


def _meta_composed(parallel, wrapper_cfg, checkpointing=None):
    """The Runner's path: build on meta, compose, materialise; returns the
    gathered plain state and the bytes this rank's parameters hold."""
    from mmpar.checkpoint import model_state
    from mmpar.parallel import setup_parallelism
    from mmpar.parallel.dtensor import local_tensor
    from mmpar.parallelize.compose import parallelize
    topology = setup_parallelism(parallel, wrapper_cfg)  # reset by harness
    torch.manual_seed(3)
    model, init = build_on_meta(lambda: MODELS.build(copy.deepcopy(LLAMA)))
    model = parallelize(model, topology, parallel, wrapper_cfg,
                        activation_checkpointing=checkpointing,
                        meta_init=init, device=torch.device('cpu'))
    held = sum(local_tensor(p).numel() for p in model.parameters())
    state = {k: v.clone() for k, v in model_state(model).items()}
    return state, held, dist.get_rank()


@pytest.mark.parametrize('layout,checkpointing', [
    *((layout, None) for layout in LAYOUTS),
    # Checkpointed blocks carry torch's wrapper in their parameter names
    # when they are materialised (before the wrapper: tp; after it: FSDP2).
    ('tp2', dict(module_classes=['LlamaBlock'], mode='full')),
    ('fsdp2', dict(module_classes=['LlamaBlock'], mode='selective'))])
def test_every_sharding_layout_materialises_the_one_process_weights(
        run_dist, layout, checkpointing):
    world_size, parallel, wrapper_cfg = LAYOUTS[layout]
    expected, _ = _one_process(lambda: MODELS.build(copy.deepcopy(LLAMA)))
    want = expected.state_dict()
    total = sum(p.numel() for p in expected.parameters())
    for state, held, rank in run_dist(_meta_composed, parallel, wrapper_cfg,
                                      checkpointing, world_size=world_size):
        persistent = {k: v for k, v in want.items() if k in state}
        assert state.keys() == persistent.keys(), rank
        for key, value in persistent.items():
            assert torch.equal(state[key], value), (rank, key)
        # Each rank holds a share, never the whole model.
        assert held < total, (rank, held, total)


# -- memory: a rank never holds the whole model --------------------------------
# ~50 M parameters: four blocks as wide as the 100 M benchmark's
# (benchmarks/bench_memory.py), so a block is as large next to the fixed
# overheads, at half the build and load work. The bound (a share plus one
# block, +15 %) is then 57 % of the model: the meta build peaks at ~70 MB of
# its 117 MB, one more block held at once breaks it (132 MB measured), the
# whole build (~220 MB) or an unmapped load (273 MB) by far.
LLAMA_50M = dict(type='Llama', vocab_size=256, dim=1024, num_layers=4,
                 num_heads=8, max_seq_len=256)


def _private_rss() -> int:
    """Resident memory minus file-backed pages (those of a memory-mapped
    checkpoint are page cache, shared by the ranks and reclaimable)."""
    from benchmarks._steps import read_status_kb
    return (read_status_kb('VmHWM') - read_status_kb('RssFile')) * 1024


def _build_peak(meta: bool, checkpoint=None):
    """The peak RSS (VmHWM) reached while building the ~50 M-parameter Llama
    and sharding it under FSDP2 (then loading ``checkpoint`` into it), above
    the RSS before; and the sharded model."""
    from benchmarks._steps import read_status_kb, reset_peak_rss
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    wrapper_cfg = dict(type='MMFullyShard', fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock']))
    topology = setup_parallelism(None, wrapper_cfg)
    reset_peak_rss()  # VmHWM from here (imports peaked higher)
    before = (read_status_kb('VmRSS') - read_status_kb('RssFile')) * 1024
    torch.manual_seed(0)
    build = lambda: MODELS.build(dict(LLAMA_50M))  # noqa: E731
    if meta:
        model, init = build_on_meta(build)
        model = parallelize(model, topology, None, wrapper_cfg,
                            meta_init=init, device=torch.device('cpu'))
    else:
        model = parallelize(build(), topology, None, wrapper_cfg)
    mapped = None
    if checkpoint is not None:
        from mmpar.checkpoint import load_checkpoint_file, load_model_state
        mapped = load_checkpoint_file(checkpoint)
        load_model_state(model, mapped, True, [])
    # (While the checkpoint is still mapped, so its pages are counted as
    # file pages now as at the peak.)
    return _private_rss() - before, model


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _build_peaks(checkpoint):
    """On every rank: the build peak on meta with ``checkpoint`` loaded, the
    loaded weights' sum, then (the first model freed, the peak reset) the
    build peak of the whole model; every rank's ``(meta peak, sum, whole
    peak)``. With glibc's mmap threshold fixed at 1 MiB, as
    ``MALLOC_MMAP_THRESHOLD_=1048576`` sets it at a process's start
    (docs/big_models.md), and put back to glibc's default after."""
    import ctypes
    libc = ctypes.CDLL('libc.so.6')
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        return _build_peaks_fixed(checkpoint)
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)


def _build_peaks_fixed(checkpoint):
    meta_peak, model = _build_peak(True, checkpoint)
    # (Gathers the whole model: after the peak is read.)
    from mmpar.checkpoint import model_state
    total = float(sum(v.double().sum() for v in model_state(model).values()))
    del model
    whole_peak, _ = _build_peak(False)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (meta_peak, total, whole_peak))
    return out


def _llama_sizes():
    model, _ = build_on_meta(lambda: MODELS.build(dict(LLAMA_50M)),
                             init_weights=False)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size()
                for p in model.layers['0'].parameters())
    return full, block


def test_meta_build_and_load_peak_is_a_share_plus_one_block(run_dist,
                                                           tmp_path):
    """4 ranks, FSDP2: building on the meta device and loading a full
    checkpoint (memory-mapped: each rank reads its rows) stay within this
    rank's share of the model plus one block (+15 %); built whole, the
    build alone does not. The ranks run with glibc's mmap threshold fixed,
    as docs/big_models.md tells CPU users who build big models (mmpar does
    not tune the allocator); each peak is the rise above the rank's RSS
    before its build, so the pool's workers measure as fresh ones."""
    full, block = _llama_sizes()
    bound = 1.15 * (full / 4 + block)
    torch.manual_seed(5)
    model = MODELS.build(dict(LLAMA_50M))
    path = str(tmp_path / 'full.pth')
    torch.save(dict(state_dict=model.state_dict()), path)
    expected = float(sum(v.double().sum() for k, v in
                         model.state_dict().items() if 'rope' not in k))
    del model
    peaks = run_dist(_build_peaks, path, world_size=4)[0]
    for meta_peak, total, _ in peaks:
        assert meta_peak <= bound, (meta_peak, bound, full)
        assert total == pytest.approx(expected)
    # (Measured after the meta build in the same process: its freed pages
    # can only make this peak smaller.)
    assert min(whole for _, _, whole in peaks) > bound, (peaks, bound)


# -- the Runner's switch ---------------------------------------------------------
def _runner_builds(config: str, work_dir: str, meta_init):
    from pathlib import Path

    from mmengine.config import Config

    from mmpar.runner import Runner
    root = Path(__file__).resolve().parents[2]
    cfg = Config.fromfile(str(root / config))
    cfg.update(launcher='pytorch', work_dir=work_dir,
               experiment_name=f'meta_{meta_init}_{dist.get_rank()}')
    if meta_init is not None:
        cfg.meta_init = meta_init
    runner = Runner.from_cfg(cfg)
    on_meta = runner.meta_init is not None
    real = not any(p.is_meta for p in runner.model.parameters())
    from mmpar.checkpoint import model_state
    state = {k: v.clone() for k, v in model_state(runner.model).items()}
    return on_meta, real, state


@pytest.mark.parametrize('config,meta_init,expected', [
    ('configs/vit_digits/vit_digits_fsdp2.py', None, True),  # the default
    ('configs/vit_digits/vit_digits_fsdp2.py', False, False),
    ('configs/vit_digits/vit_digits.py', None, False),  # DDP replicates
])
def test_runner_builds_sharded_layouts_on_meta_unless_told_not(
        run_dist, tmp_path, config, meta_init, expected):
    results = run_dist(_runner_builds, config, str(tmp_path), meta_init)
    for on_meta, real, _ in results:
        assert on_meta is expected and real
    # Either way the ranks start from the same weights.
    assert results[0][2].keys() == results[1][2].keys()
    for key, value in results[0][2].items():
        assert torch.equal(value, results[1][2][key]), key


def test_runner_refuses_a_bad_meta_init_naming_it(tmp_path):
    from pathlib import Path

    from mmengine.config import Config

    from mmpar.config_check import check_config
    root = Path(__file__).resolve().parents[2]
    cfg = Config.fromfile(str(root / 'configs/vit_digits/vit_digits.py'))
    cfg.meta_init = 'auto'
    with pytest.raises(ConfigError, match="meta_init='auto'.*True"):
        check_config(cfg)
