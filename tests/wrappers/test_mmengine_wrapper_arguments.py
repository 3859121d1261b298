"""MMEngine's MMDistributedDataParallel arguments that torch's DDP lacks
(``detect_anomalous_params``) are refused at start-up by name, and the docs
for MMEngine users say so instead of "the same arguments"."""
import inspect

import pytest
from mmengine.config import Config
from mmengine.model import MMDistributedDataParallel as MMEngineDDP
from torch.nn.parallel import DistributedDataParallel

from mmpar.config_check import check_config
from mmpar.failures import ConfigError
from tests.e2e import DEFAULT_CONFIG, ROOT

MMENGINE_ONLY = sorted(
    set(inspect.signature(MMEngineDDP).parameters) -
    set(inspect.signature(DistributedDataParallel).parameters) -
    {'kwargs'})


def test_mmengine_only_arguments_are_known():
    assert MMENGINE_ONLY == ['detect_anomalous_params']


@pytest.mark.parametrize('name', MMENGINE_ONLY)
def test_refused_by_name_and_documented(name):
    cfg = Config.fromfile(str(ROOT / DEFAULT_CONFIG)).to_dict()
    cfg['model_wrapper_cfg'] = dict(type='MMDistributedDataParallel',
                                    **{name: True})
    with pytest.raises(ConfigError, match=f'takes no argument {name!r}'):
        check_config(cfg)
    for doc in ('docs/mmengine_users.md', 'docs/wrappers.md'):
        text = (ROOT / doc).read_text()
        assert f'`{name}`' in text, doc
        assert 'find_unused_parameters=True' in text, doc
