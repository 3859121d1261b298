"""``--cfg-options KEY=VALUE ...`` for every tool: MMEngine's parsing, with
errors that name the pair (its own module: the tools' command lines in
``mmpar.cli`` and ``mmpar.analysis`` both use it)."""
import argparse

from mmengine.config import DictAction


class CfgOptionsAction(DictAction):
    """MMEngine's ``DictAction`` with errors that name the bad pair.

    ``DictAction`` raises a bare unpacking ``ValueError`` for a pair without
    ``=``, an ``AssertionError`` for unbalanced brackets, and recurses until
    ``RecursionError`` on ``dict(...)`` inside a list.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        options = dict(getattr(namespace, self.dest, None) or {})
        for pair in values:
            key, sep, value = pair.partition('=')
            if not sep or not key:
                raise argparse.ArgumentError(
                    self, f'{pair!r} is not KEY=VALUE; allowed: e.g. '
                    'train_cfg.max_epochs=3 or model.depth=2')
            try:
                # MMEngine's own DictAction on this one pair: values as it
                # reads them.
                parsed = argparse.Namespace()
                super().__call__(parser, parsed, [pair], option_string)
                options[key] = getattr(parsed, self.dest)[key]
            except (AssertionError, ValueError, RecursionError) as err:
                raise argparse.ArgumentError(
                    self, f'cannot parse the value of {key!r} in {pair!r} '
                    f'({type(err).__name__}: {str(err)[:80]}); allowed: '
                    'numbers, strings, True/False/None and [...] or (...) '
                    'of them; put dicts in a config file') from None
        setattr(namespace, self.dest, options)
