"""benchmarks/verify_shipped.py without launching anything: the configs it
finds, the world size each documents, the options that shrink them, the
verdict it reads from dist_verify.sh's output and the table it prints (the
table itself is the driver's full run, docs/verify.md)."""
from mmengine.config import Config

from benchmarks import verify_shipped as vs

AGREE = ('step 0: 98 values agree\nstep 1: 98 values agree\n'
         'all 2 steps agree (max relative difference 3.01e-06; rtol 0.001, '
         'atol 1e-07)\ncost: reference 1.0 s, layout 2.0 s for 2 steps\n')
DIFFERS = ('step 0: 98 values agree\nstep 1 differs first at module `head` '
           '(gradient of bias): relative difference 0.0048 (rtol 0.001, '
           'atol 1e-07)\n  agreed before it in step 1: 23 values\n')


def test_every_shipped_folder_and_its_documented_world_size():
    names = {p.name: p for p in vs.shipped_configs()}
    assert {'vit_digits.py', 'llama_shakespeare_moe_ep.py',
            'llama_shakespeare_hf_sft.py'} <= set(names)
    assert vs.documented_ranks(names['vit_digits_tp_custom.py']) == 4
    assert vs.documented_ranks(names['llama_shakespeare_cp.py']) == 4
    # The command split over two comment lines.
    assert vs.documented_ranks(
        names['vit_digits_fsdp_custom_policy.py']) == 2
    assert vs.documented_ranks(names['llama_shakespeare_pp_tp.py']) == 4
    # --documented: its own 8 (pp=2 x tp=2 x dp_shard=2).
    assert vs.documented_ranks(names['llama_shakespeare_pp_tp.py'],
                               here=False) == 8
    assert vs.documented_ranks(names['llama_corpus.py']) == 2  # none
    assert vs.shipped_configs('configs/hf_finetune/*_tp.py') == [
        names['llama_shakespeare_hf_finetune_tp.py']]


def test_shrinking_keeps_the_layout():
    pp = Config.fromfile(str(vs.ROOT / 'configs/vit_digits/vit_digits_pp.py'))
    opts = vs.shrink_options(pp)
    assert opts['model.depth'] == 2
    assert opts['parallel.pipeline.split_points'] == ['blocks.1']
    assert not any(k.startswith(('parallel.pp', 'parallel.tp',
                                 'model_wrapper_cfg')) for k in opts)
    moe = Config.fromfile(str(
        vs.ROOT / 'configs/llama_shakespeare/llama_shakespeare_moe_ep.py'))
    opts = vs.shrink_options(moe)
    assert opts['model.dim'] == 32 and opts['model.moe.hidden_dim'] == 32
    moe.merge_from_dict(opts)
    assert vs.layout_of(moe, 2) == 'ep=2 (MMFullyShard)'
    hf = Config.fromfile(str(
        vs.ROOT / 'configs/llama_shakespeare/llama_shakespeare_hf.py'))
    assert vs.shrink_options(hf)['model.config.hidden_size'] == 32
    assert vs._option_words({'a.b': ['x', 'y'], 'c': 2}) == [
        "a.b=['x','y']", 'c=2']


def test_verdicts_and_table():
    assert vs.verdict_of(AGREE, 0, 2) == 'agree (3.01e-06)'
    # Fewer steps than asked for (e.g. accumulation ate them) is no agree.
    assert vs.verdict_of(AGREE, 0, 3).startswith('**error** (exit 0)')
    assert vs.verdict_of(DIFFERS, 1, 2) == (
        '**differs**: step 1 differs first at module `head` (gradient of '
        'bias): relative difference 0.0048 (rtol 0.001, atol 1e-07)')
    failed = 'step 0: the layout failed in module `fc`: RuntimeError: x\n'
    assert vs.verdict_of(failed, 1, 2).startswith('**differs**: step 0: ')
    assert vs.verdict_of('', 1, 2, 'Traceback\nValueError: bad\n') == \
        '**error** (exit 1): ValueError: bad'
    rows = [vs.Row('configs/a.py', 'tp=2 (plan \'x\')', 2, 'agree (1e-06)'),
            vs.Row('configs/b.py', 'pp=2', 2, 'a | b')]
    assert vs.table(rows, 2).splitlines() == [
        '| config | layout | ranks | verdict (2 steps, max relative '
        'difference) |', '|---|---|---|---|',
        "| `configs/a.py` | tp=2 (plan 'x') | 2 | agree (1e-06) |",
        '| `configs/b.py` | pp=2 | 2 | a \\| b |']
