"""``mmengine.``-prefixed wrapper names resolve as docs/configs.md says."""
import logging

import pytest
from mmengine.model import MMSeparateDistributedDataParallel

from mmpar.wrappers import (MMDistributedDataParallel,
                            MMFullyShardedDataParallel)
from mmpar.wrappers import builder
from mmpar.wrappers.builder import _notice_twin, wrapper_class


@pytest.mark.parametrize('name,cls', [
    ('MMDistributedDataParallel', MMDistributedDataParallel),
    ('MMFullyShardedDataParallel', MMFullyShardedDataParallel),
])
def test_mmengine_name_builds_mmpar_twin_with_one_notice(
        name, cls, monkeypatch):
    _notice_twin.cache_clear()
    logged = []
    monkeypatch.setattr(builder, 'print_log',
                        lambda msg, **kw: logged.append((msg, kw['level'])))
    assert wrapper_class(f'mmengine.{name}') is cls
    assert wrapper_class(f'mmengine.{name}') is cls
    notices = [msg for msg, level in logged
               if f'mmengine.{name}' in msg and level == logging.WARNING]
    assert len(notices) == 1, logged
    assert f'using mmpar.{name}' in notices[0]


def test_mmengine_wrapper_mmpar_lacks_stays_mmengines():
    assert wrapper_class('mmengine.MMSeparateDistributedDataParallel') is \
        MMSeparateDistributedDataParallel


def test_bare_and_mmpar_names_unchanged():
    assert wrapper_class('MMDistributedDataParallel') is \
        MMDistributedDataParallel
    assert wrapper_class('mmpar.MMFullyShardedDataParallel') is \
        MMFullyShardedDataParallel
