"""The kernels moved to ``helpers/kernels/``; a learner's notebook saved before the move imports the old paths
(the generator never overwrites a learner's notebook), so those still give the same objects."""
import importlib

import pytest

import kernel_env  # noqa: F401  (sets TRITON_INTERPRET first)

MOVED = {
    "helpers.triton_attention": {"flash_attn_triton": "helpers.kernels.forward",
                                 "flash_decode_triton": "helpers.kernels.decode", "interpreting": "helpers.triton_mode"},
    "helpers.triton_attention_bwd": {"flash_attention": "helpers.kernels.backward",
                                     "flash_attn_bwd_triton": "helpers.kernels.backward",
                                     "FlashAttentionFunction": "helpers.kernels.backward",
                                     "DEFAULT_DQ_MODE": "helpers.kernels.backward",
                                     "dkdv_teaching": "helpers.lesson08_dkdv"},
    "helpers.triton_varlen": {"flash_attn_varlen_triton": "helpers.kernels.varlen",
                              "varlen_block_map": "helpers.kernels.varlen", "varlen_block_m": "helpers.kernels.varlen"},
    "helpers.triton_kvcache": {"flash_attn_with_kvcache_triton": "helpers.kernels.kvcache"},
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_paths_give_the_new_objects(old):
    module = importlib.import_module(old)
    assert sorted(module.__all__) == sorted(MOVED[old])
    for name, new in MOVED[old].items():
        assert getattr(module, name) is getattr(importlib.import_module(new), name), f"{old}.{name}"
