"""Triton kernels of llmpar, installed as ``llmpar.kernels``. They know nothing of llmpar: llmpar/ops/ wraps them.

Importable without triton: ``HAS_TRITON`` says whether the kernels can run, ``TRITON_IMPORT_ERROR`` why not.

This folder sits at the top of a clone (``kernels/``), so a script, ``python -m ...`` or ``python -c`` run from the
clone's root, which puts the root first on ``sys.path``, would find it under the bare name ``kernels`` and shadow
any installed package of that name (Hugging Face's ``kernels``, which transformers imports). Imported under that
name, this module hands the import on to the installed package, or fails as if the folder were not there: the
working directory never changes what ``import kernels`` means.
"""

from __future__ import annotations

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named 'kernels' (the folder {_root}/kernels is llmpar's Triton kernels, imported as "
            "llmpar.kernels, not a package named 'kernels')",
            name="kernels",
        )
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # what `import kernels` returns once this module body ends
    _spec.loader.exec_module(_module)
else:
    from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR

    __all__ = ["HAS_TRITON", "INTERPRETED", "TRITON_IMPORT_ERROR"]
