"""lazyrag: batch retrieval-augmented generation over a fixed corpus with deferred positional encoding."""
import importlib.machinery
import os
import sys

# A checkout's kernels/ folder is installed as lazyrag.kernels, but with the checkout on sys.path (python -m or
# -c inside it, or Ray adding the driver's directory to every worker) it would also shadow the PyPI `kernels`
# that transformers imports. This finder looks `kernels` up everywhere but there.
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
_CHECKOUT = _ROOT if os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) else None


class _PyPIKernelsFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "kernels":
            return None
        elsewhere = [p for p in sys.path if not (isinstance(p, str) and os.path.realpath(p or os.curdir) == _CHECKOUT)]
        return importlib.machinery.PathFinder.find_spec(name, elsewhere)


if _CHECKOUT and not any(isinstance(f, _PyPIKernelsFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _PyPIKernelsFinder())
