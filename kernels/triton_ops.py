"""The Triton kernels behind the public API, with the reference's signatures (no argument checks)."""
from .bit_matrix import bit_rows
from .decode import lazy_decode
from .page_copy import rotate_copy
from .page_rows import rows_to_pages
from .prefill import lazy_prefill
from .shared_attention import shared_decode, shared_prefill

__all__ = ["bit_rows", "lazy_decode", "lazy_prefill", "rotate_copy", "rows_to_pages", "shared_decode",
           "shared_prefill"]
