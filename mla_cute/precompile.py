"""``python -m mla_cute.precompile``: the command line over ``mla_cute.precompile`` (``_precompile_cli.py``).

Importing this module binds it as ``mla_cute.precompile``, where the function lives: the module is callable as
that function, so ``mla_cute.precompile([...])`` works either way."""

from __future__ import annotations

import sys
import types

from ._precompile_cli import main
from .api import precompile as _precompile


class _CallableModule(types.ModuleType):
    def __call__(self, configs, *, schedule=None):
        return _precompile(configs, schedule=schedule)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
