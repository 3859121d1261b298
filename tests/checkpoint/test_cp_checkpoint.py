"""Context parallelism holds no parameter shards of its own: a checkpoint
saved at cp=2 x FSDP2 dp_shard=2 (4 ranks, sharded) resumes at cp=1
(FSDP2 over dp_shard=2) and at cp=2 alone (2 ranks) with the optimizer
state exactly as saved, and its full form loads strictly into the plain
Llama."""
from mmengine.config import Config

from tests.checkpoint.test_sharded_checkpoint import (_assert_resumed_state,
                                                      _CaptureLoaded,
                                                      _named_saved_state)
from tests.configs.test_llama_configs import ROOT, _shrunk_cfg

CONFIG = 'configs/llama_shakespeare/llama_shakespeare_cp.py'
NO_VAL = dict(val_cfg=None, val_dataloader=None, val_evaluator=None)


def _save(work_dir):
    from mmpar.runner import Runner
    Runner.from_cfg(_shrunk_cfg(CONFIG, work_dir, 'cp_save', 2,
                                **NO_VAL)).train()


def _resume(ckpt, work_dir, name, cp):
    from mmpar.runner import Runner
    cfg = _shrunk_cfg(CONFIG, work_dir, name, 4, resume=True,
                      load_from=str(ckpt), **NO_VAL)
    cfg.parallel.cp = cp
    runner = Runner.from_cfg(cfg)
    hook = _CaptureLoaded()
    runner._hooks.insert(0, hook)
    runner.train()
    return hook.state, runner.iter, runner.topology.dims.as_dict()


def test_cp_checkpoint_resumes_at_other_layouts(run_dist, tmp_path):
    from mmpar.checkpoint.sharded import sharded_to_full
    from mmpar.models.llama import Llama
    run_dist(_save, str(tmp_path / 'saved'), world_size=4)
    ckpt = tmp_path / 'saved' / 'iter_2'
    full = sharded_to_full(str(ckpt))
    cfg = Config.fromfile(str(ROOT / CONFIG))
    cfg.merge_from_dict({'model.dim': 32, 'model.num_layers': 2,
                         'model.num_heads': 2})
    model_cfg = {k: v for k, v in cfg.model.items() if k != 'type'}
    plain = Llama(**model_cfg)
    plain.load_state_dict(full['state_dict'], strict=True)
    saved = _named_saved_state(full, plain)
    for cp in (1, 2):
        results = run_dist(_resume, ckpt, str(tmp_path / f'cp{cp}'),
                           f'cp_resume_{cp}', cp)
        for state, iteration, dims in results:
            assert (dims['cp'], dims['dp_shard']) == (cp, 2 // cp)
            _assert_resumed_state(state, saved)
            assert iteration == 4
