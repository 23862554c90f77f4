"""Megatron-Core's MoE router without TransformerEngine: ``moe_utils.RouterGatingLinearFunction`` tests
``te_general_gemm is not None``, but the name is bound only when TE imports, so without TE the router's
first forward raises NameError. `define_missing_te_gemm` binds it to None, the value the code already
handles (a plain ``torch.mm`` in the router dtype). A no-op when the name exists or outside
`MOE_WITHOUT_TE.versions`; the call sites are pinned in `tests/test_patches.py`.
"""

from __future__ import annotations

from . import MOE_WITHOUT_TE

__all__ = ["define_missing_te_gemm"]


def define_missing_te_gemm() -> bool:
    """Bind ``moe_utils.te_general_gemm = None`` when it is missing; True when it did."""
    if not MOE_WITHOUT_TE.applies():
        return False
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
