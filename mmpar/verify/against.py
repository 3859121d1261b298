"""The reference layout of ``--against``: one process, or a parallel layout
written as ``AXIS=SIZE[,AXIS=SIZE...][,wrapper=TYPE]`` (``dp_shard=2``,
``dp_replicate=2,dp_shard=2,wrapper=MMFullyShard``), and, under a
``--memory-budget``, the smallest reference that fits it
(docs/verify.md)."""
import copy
import math
from typing import Dict, NamedTuple, Optional, Tuple

from mmengine.config import Config

from mmpar.failures import ConfigError
from mmpar.parallel.axes import AXES, SAMPLE_AXES
from mmpar.parallel.config import SEED_SIZE_KEYS

ONE_PROCESS = 'one-process'
# The axes a reference may use: its module outputs must be whole along each
# row (verify gathers a layout's tp outputs against the reference's full
# shapes, so a tp reference's split outputs would compare as whole ones),
# and its per-rank batch is the global batch over the ranks that read
# different samples (dp_replicate x dp_shard x ep). Every axis but tp.
REFERENCE_AXES = tuple(axis for axis in AXES if axis != 'tp')
ALLOWED = (f'{ONE_PROCESS}, or AXIS=SIZE[,AXIS=SIZE...][,wrapper=TYPE] with '
           f'AXIS in {", ".join(REFERENCE_AXES)} and sizes >= 1 whose '
           'product is >= 2 (e.g. dp_shard=2)')


class Reference(NamedTuple):
    """A parsed ``--against``: the axes' sizes (empty for one process) and
    the wrapper type (None: the config's own)."""
    sizes: Tuple[Tuple[str, int], ...] = ()
    wrapper: Optional[str] = None

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.sizes)

    @property
    def label(self) -> str:
        """The canonical ``--against`` text."""
        if not self.sizes:
            return ONE_PROCESS
        words = [f'{axis}={size}' for axis, size in self.sizes]
        if self.wrapper:
            words.append(f'wrapper={self.wrapper}')
        return ','.join(words)


def parse_against(text: str) -> Reference:
    """``--against``'s value as a :class:`Reference`.

    Raises:
        ConfigError: naming ``--against``, the value and what is allowed.
    """
    if text == ONE_PROCESS:
        return Reference()

    def bad(why: str) -> ConfigError:
        return ConfigError(f'--against={text!r}: {why}; allowed: {ALLOWED}')

    sizes: Dict[str, int] = {}
    wrapper = None
    for word in str(text).split(','):
        key, sep, value = word.strip().partition('=')
        if not sep or not value:
            raise bad(f'{word.strip()!r} is not KEY=VALUE')
        if key == 'wrapper':
            wrapper = value
            continue
        if key == 'tp':
            raise bad('a tensor-parallel reference is not supported (its '
                      'module outputs are split, the reference\'s must be '
                      'whole)')
        if key not in REFERENCE_AXES:
            raise bad(f'unknown axis {key!r}')
        if key in sizes:
            raise bad(f'{key} given twice')
        if not value.isdigit() or int(value) < 1:
            raise bad(f'{key}={value} is not an int >= 1')
        sizes[key] = int(value)
    reference = Reference(
        tuple((axis, sizes[axis]) for axis in AXES if axis in sizes), wrapper)
    if reference.world_size < 2:
        raise bad(f'{reference.world_size} rank (use {ONE_PROCESS})')
    return reference


def against_config(cfg: Config, reference: Reference, global_batch: int,
                   text: str) -> Config:
    """``cfg`` at the parallel ``reference`` layout, reading
    ``global_batch`` samples a step: the ``parallel`` section's axes
    replaced (its ``tp_plan`` dropped, its ``pipeline`` kept for ``pp``),
    the wrapper the reference's or the config's own, the per-rank batch the
    global batch over the reference's data ranks. The config is not
    changed.

    Raises:
        ConfigError: naming ``--against`` (``text``) when the reference's
            data ranks do not split the global batch, or ``pp`` without a
            ``parallel.pipeline`` section.
    """
    axes = dict(reference.sizes)
    data = math.prod(axes.get(axis, 1) for axis in SAMPLE_AXES)
    if global_batch % data:
        raise ConfigError(
            f'--against={text!r}: the global batch of {global_batch} samples '
            f'does not split over its {data} data ranks; allowed: a '
            'reference whose dp_replicate x dp_shard x ep divides it')
    given = dict(cfg.get('parallel') or {})
    if axes.get('pp', 1) > 1 and not given.get('pipeline'):
        raise ConfigError(
            f'--against={text!r}: pp needs the config\'s parallel.pipeline '
            '(split points, schedule); allowed: pp on a config that has one')
    section = {key: value for key, value in given.items()
               if key not in AXES + SEED_SIZE_KEYS + ('tp_plan', 'pipeline')}
    section.update(axes)
    if axes.get('pp', 1) > 1:
        section['pipeline'] = copy.deepcopy(given['pipeline'])
    cfg = copy.deepcopy(cfg)
    cfg.parallel = section
    if reference.wrapper:
        cfg.model_wrapper_cfg = dict(type=reference.wrapper)
    cfg.train_dataloader.batch_size = global_batch // data
    return cfg
