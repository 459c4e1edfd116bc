"""megatron_plugin.te_compat: megatron-core 0.16's MoE router GEMM without Transformer Engine (the llm lane has none).
Stock raises NameError on the router's forward (as it did on an H200, tests/gpu/recipe_torchrun_nccl.py); after
``apply`` the router logits are exactly ``torch.mm``'s."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")


def test_router_gemm_without_te_fails_in_stock_and_is_torch_mm_after_apply(monkeypatch) -> None:
    from megatron.core.transformer.moe import moe_utils

    from megatron_plugin import te_compat

    if getattr(moe_utils, "HAVE_TE", False):
        pytest.fail("this lane is meant to run without Transformer Engine; the test would not test the fix")
    # stock, whatever ran before in this process
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    g = torch.Generator().manual_seed(0)
    inp, weight = torch.randn(6, 16, generator=g), torch.randn(4, 16, generator=g)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    assert te_compat.apply() is True
    assert te_compat.apply() is False  # the second call finds the name defined
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    assert torch.equal(out, torch.mm(inp, weight.t()))
