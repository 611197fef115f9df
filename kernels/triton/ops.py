"""The decoder's elementwise ops as Triton kernels: a drop-in alternative to ``kernels.ops``.

Same names, signatures and semantics as the torch references, so a model may use either module.
"""

from __future__ import annotations

from .activation import silu_and_mul
from .norm import add_rms_norm, rms_norm
from .rotary import apply_rotary, apply_rotary_and_store_kv

__all__ = ["add_rms_norm", "apply_rotary", "apply_rotary_and_store_kv", "rms_norm", "silu_and_mul"]
