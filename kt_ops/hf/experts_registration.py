"""``experts_implementation="kt"`` after a bare ``import kt_ops``, without importing transformers.

transformers checks the name against its experts registry when a model is built or
``set_experts_implementation`` is called, so ``"kt"`` must be in that registry by then. Importing
transformers from ``import kt_ops`` would cost every user of the ops alone seconds, so instead:
if transformers' experts module is already imported, ``"kt"`` is registered now; otherwise a
one-shot import hook registers it right after that module first loads (whoever imports it).
"""
from __future__ import annotations

import importlib.abc
import sys

_EXPERTS_MODULE = "transformers.integrations.moe"


def _register() -> None:
    from kt_ops.hf.experts import register_kt_experts

    register_kt_experts()


class _RegisterAfterLoading(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders for transformers' experts module and wraps
    its loader so that ``"kt"`` is registered once the module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _EXPERTS_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding this finder
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run_module = spec.loader.exec_module

                def exec_module(module, run_module=run_module):
                    run_module(module)
                    _register()

                spec.loader.exec_module = exec_module
                return spec
        return None


def register_when_transformers_loads() -> None:
    """Make ``"kt"`` a transformers experts implementation now or when transformers loads it."""
    if _EXPERTS_MODULE in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterLoading) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLoading())
