"""A small table of real MoE models, to turn a slot count into bytes (docs/semantics.md §11.1).

Each entry holds one SwiGLU expert's geometry (``W = 3 * d_model * d_expert * bytes``) and what
the cache sees of the model (``L``, ``E``, top-k), from its published Hugging Face config.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MoEModel", "MODELS", "DTYPE_BITS", "DEFAULT_DTYPE", "resolve_model"]

#: Bits per weight of each dtype a model may be served in.
DTYPE_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "fp8": 8, "int8": 8, "int4": 4}
DEFAULT_DTYPE = "bf16"


@dataclasses.dataclass(frozen=True)
class MoEModel:
    """One model's MoE geometry.

    Attributes:
      name: the key of :data:`MODELS`.
      d_model: hidden size.
      d_expert: the routed expert's FFN width (``moe_intermediate_size``).
      moe_layers: layers with a routed MoE block (``L`` of the cache).
      total_layers: all decoder layers (dense ones included).
      routed_experts: routed experts per MoE layer (``E``).
      top_k: routed experts per token per layer.
      shared_experts: always-resident experts per MoE layer; not cached, not counted.
      source: where the numbers come from.
    """

    name: str
    d_model: int
    d_expert: int
    moe_layers: int
    total_layers: int
    routed_experts: int
    top_k: int
    shared_experts: int
    source: str

    def expert_bytes(self, dtype: str = DEFAULT_DTYPE) -> int:
        """``W = 3 * d_model * d_expert * bits / 8``: one routed expert's weights in ``dtype``."""
        if dtype not in DTYPE_BITS:
            raise ValueError(f"unknown dtype {dtype!r} for {self.name}: expected one of "
                             f"{', '.join(DTYPE_BITS)}")
        return 3 * self.d_model * self.d_expert * DTYPE_BITS[dtype] // 8


MODELS: dict[str, MoEModel] = {
    model.name: model for model in (
        MoEModel("mixtral-8x7b", d_model=4096, d_expert=14336, moe_layers=32, total_layers=32,
                 routed_experts=8, top_k=2, shared_experts=0,
                 source="mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size, intermediate_size, "
                        "num_hidden_layers, num_local_experts, num_experts_per_tok"),
        MoEModel("deepseek-v2-lite", d_model=2048, d_expert=1408, moe_layers=26, total_layers=27,
                 routed_experts=64, top_k=6, shared_experts=2,
                 source="deepseek-ai/DeepSeek-V2-Lite config.json: moe_intermediate_size, "
                        "first_k_dense_replace=1, n_routed_experts, n_shared_experts"),
        MoEModel("qwen3-30b-a3b", d_model=2048, d_expert=768, moe_layers=48, total_layers=48,
                 routed_experts=128, top_k=8, shared_experts=0,
                 source="Qwen/Qwen3-30B-A3B config.json: moe_intermediate_size, num_experts, "
                        "num_experts_per_tok"),
    )
}


def resolve_model(text: str) -> tuple[MoEModel, str]:
    """``"mixtral-8x7b"`` or ``"mixtral-8x7b:fp8"`` -> ``(model, dtype)`` (raises ValueError)."""
    name, _, dtype = str(text).partition(":")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODELS)} "
                         f"(or give --expert-bytes)")
    dtype = dtype or DEFAULT_DTYPE
    MODELS[name].expert_bytes(dtype)  # validates the dtype
    return MODELS[name], dtype
