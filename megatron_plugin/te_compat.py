"""Megatron-core 0.16 without Transformer Engine: a name its MoE router uses but never defines, on CPU and GPU alike.

``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` inside a ``try`` that, without Transformer
Engine, leaves the name undefined, yet ``RouterGatingLinearFunction.forward`` tests ``te_general_gemm is not None``:
every MoE forward then dies with ``NameError`` (measured on an H200 with megatron-core 0.16.1, torch 2.11, no TE).
Defining the name as ``None`` takes the ``torch.mm`` branch that code already has for this case. Nothing changes
where Transformer Engine is installed (the name exists) or in versions that define it.
"""

from __future__ import annotations

import logging

log = logging.getLogger("flowlane")

#: ``TransformerConfig`` fields that turn off Megatron-core's kernel fusions, for runs without Apex or Transformer
#: Engine: persistent LayerNorm, the masked softmax, RoPE and the gradient-accumulation GEMM need their compiled
#: kernels; the jit-scripted bias-GeLU and bias-dropout-add need a CUDA tensor. ``TransformerConfig(..., **UNFUSED)``
UNFUSED: dict[str, bool] = {
    "bias_activation_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "bias_dropout_fusion": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
}


def apply() -> bool:
    """Define ``moe_utils.te_general_gemm = None`` where megatron-core left it undefined. True when it did."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    log.info(
        "megatron-core without Transformer Engine: MoE router GEMM through torch.mm (te_general_gemm = None)"
    )
    return True
