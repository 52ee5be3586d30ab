"""Moved to ``helpers.kernels.backward`` (and lesson 08's teaching launcher to ``helpers.lesson08_dkdv``): these
names stay importable from here for notebooks saved before the move."""
from .kernels.backward import DEFAULT_DQ_MODE, FlashAttentionFunction, flash_attention, flash_attn_bwd_triton
from .lesson08_dkdv import dkdv_teaching

__all__ = ["flash_attention", "flash_attn_bwd_triton", "FlashAttentionFunction", "DEFAULT_DQ_MODE", "dkdv_teaching"]
