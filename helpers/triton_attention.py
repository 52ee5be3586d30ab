"""Moved to ``helpers.kernels.forward`` and ``helpers.kernels.decode``: these names stay importable from here
for notebooks saved before the move (the generator never overwrites a learner's notebook)."""
from .kernels.decode import flash_decode_triton
from .kernels.forward import flash_attn_triton
from .triton_mode import interpreting

__all__ = ["flash_attn_triton", "flash_decode_triton", "interpreting"]
