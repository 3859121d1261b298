"""benchmarks/bench_async_checkpoint.py --llama without launching a run
(two launches of the 100 M Llama are minutes of CPU): its config overrides
against the real config, how it reads the logged iteration times, and which
iterations it counts as the step that saves."""
import argparse
import json
import os

import pytest
from mmengine.config import Config, DictAction

from benchmarks import bench_async_checkpoint as bench


def test_options_make_the_100m_llama_and_save_sharded_every_k():
    options = bench.llama_options(9, 4, 64, True, bench.LLAMA_100M)
    cfg = Config.fromfile(os.path.join(bench.ROOT, bench.LLAMA_CONFIG))
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    cfg.merge_from_dict(
        parser.parse_args(['--cfg-options', *options]).cfg_options)
    assert cfg.checkpoint_format == 'sharded'
    assert cfg.model_wrapper_cfg.type == 'MMFullyShard'
    assert (cfg.model.dim, cfg.model.num_layers, cfg.model.num_heads,
            cfg.model.max_seq_len) == (1024, 8, 8, 64)
    for loader in ('train', 'val', 'test'):
        assert cfg[f'{loader}_dataloader'].dataset.context_length == 64
    assert cfg.train_dataloader.batch_size == 1
    hook = cfg.default_hooks.checkpoint
    assert (hook.interval, hook.save_last, hook.async_save) == (4, False,
                                                                True)
    assert cfg.default_hooks.logger.interval == 1
    assert cfg.log_processor.window_size == 1
    assert cfg.train_cfg.max_iters == 9
    assert cfg.train_cfg.val_begin > 9  # no validation at the end


def test_the_iteration_after_a_save_is_the_step_that_saves(tmp_path):
    vis = tmp_path / '20261128_000000' / 'vis_data'
    vis.mkdir(parents=True)
    # Saves after iterations 4 and 8: iterations 5 and 9 hold them;
    # 1 and 2 are warm-up.
    logged = {1: 9.0, 2: 3.0, 3: 1.0, 4: 1.2, 5: 2.0, 6: 1.1, 7: 0.9,
              8: 1.0, 9: 3.0}
    with open(vis / 'scalars.json', 'w') as file:
        for step, time in logged.items():
            file.write(json.dumps(dict(lr=1e-3, time=time, step=step)) + '\n')
    times = bench.iteration_times(str(tmp_path))
    assert times == logged
    row = bench.summarize(times, 4, [4.0, 6.0])
    assert row['normal'] == pytest.approx(1.0)  # median of 3, 4, 6, 7, 8
    assert row['saving'] == pytest.approx(2.5)  # median of 5 and 9
    assert row['ratio'] == pytest.approx(2.5)
    assert row['written'] == pytest.approx(5.0)
    assert bench.summarize(times, 4, [])['written'] is None
    with pytest.raises(RuntimeError, match='no saving'):
        bench.summarize({1: 1.0, 2: 1.0, 3: 1.0}, 4, [])
