"""lazyrag: batch retrieval-augmented generation over a fixed corpus with deferred positional encoding."""
import os
import sys

# The checkout's kernels/ folder is installed as lazyrag.kernels. With the checkout itself on sys.path
# (python -m or -c run inside it), it would also shadow the PyPI `kernels` that transformers imports.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:] = [p for p in sys.path if not (isinstance(p, str) and os.path.realpath(p or os.curdir) == _CHECKOUT)]
