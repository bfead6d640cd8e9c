"""A small table of real MoE models, to turn a slot count into bytes (docs/semantics.md §11.1).

Each entry holds one SwiGLU expert's geometry (``W = 3 * d_model * d_expert * bytes``, plus the
block scales of a block-quantized format), what the cache sees of the model (``L``, ``E``,
top-k) from its published Hugging Face config, and the weight format it was released in.
"""

from __future__ import annotations

import dataclasses

from pallas_cache.formats import FORMATS, INT4_GROUP, bytes_per_expert

__all__ = ["MoEModel", "MODELS", "DTYPE_BITS", "BLOCK_FORMATS", "DEFAULT_DTYPE",
           "resolve_model"]

#: Bits per weight of each plain dtype a model may be served in (no scales).
DTYPE_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "fp8": 8, "int8": 8, "int4": 4}
#: Block-quantized formats: ``(bits per weight, block rows, block columns, bytes per block
#: scale)``. ``fp8-b128``: FP8 E4M3 with one float32 scale per 128 x 128 block of each matrix
#: (DeepSeek-V3's ``weight_block_size: [128, 128]``; partial blocks at an edge count whole).
#: ``mxfp4``: OCP microscaling FP4 E2M1, one 8-bit E8M0 scale per 32 weights along a row
#: (4.25 bits per weight; gpt-oss's expert weights).
BLOCK_FORMATS = {"fp8-b128": (8, 128, 128, 4), "mxfp4": (4, 1, 32, 1)}
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
    default_dtype: str = DEFAULT_DTYPE

    def expert_bytes(self, dtype: str | None = None) -> int:
        """One routed expert's weights in ``dtype`` (default: the released format): ``3 *
        d_model * d_expert * bits / 8``, plus each of the 3 matrices' block scales for a block
        format (:data:`BLOCK_FORMATS`); for a format the library's expert functions read
        (``fp32``, ``bf16``, ``int8``, ``int4``) what its bank stores, scales included
        (:func:`pallas_cache.formats.bytes_per_expert`)."""
        dtype = self.default_dtype if dtype is None else dtype
        weights = self.d_model * self.d_expert
        if dtype in FORMATS:  # what the library's bank stores, scales included
            return bytes_per_expert(self.d_model, self.d_expert, dtype)
        if dtype in DTYPE_BITS:
            return 3 * weights * DTYPE_BITS[dtype] // 8
        if dtype in BLOCK_FORMATS:
            bits, rows, cols, scale = BLOCK_FORMATS[dtype]
            blocks = -(-self.d_model // rows) * -(-self.d_expert // cols)
            return 3 * (weights * bits // 8 + blocks * scale)
        raise ValueError(f"unknown dtype {dtype!r} for {self.name}: expected one of "
                         f"{', '.join([*DTYPE_BITS, *BLOCK_FORMATS])}")

    def weight_label(self, dtype: str | None = None) -> str:
        """How ``W`` is made, for the table's header: ``mixtral-8x7b bf16: W = 3 x 4096 x 14336
        x 16 bits = 336MiB``; a block format names its scales."""
        from pallas_cache.sizing.units import format_bytes

        dtype = self.default_dtype if dtype is None else dtype
        width = format_bytes(self.expert_bytes(dtype))
        shape = f"3 x {self.d_model} x {self.d_expert}"
        if dtype == "int8":
            return (f"{self.name} {dtype}: W = {shape} x 8 bits + a 32-bit scale per output "
                    f"channel = {width}")
        if dtype == "int4":
            return (f"{self.name} {dtype}: W = {shape} x 4 bits + a 32-bit scale per "
                    f"{INT4_GROUP} weights of a row = {width}")
        if dtype in DTYPE_BITS:
            return f"{self.name} {dtype}: W = {shape} x {DTYPE_BITS[dtype]} bits = {width}"
        bits, rows, cols, scale = BLOCK_FORMATS[dtype]
        return (f"{self.name} {dtype}: W = {shape} x {bits} bits + one {8 * scale}-bit scale per "
                f"{rows} x {cols} block = {width}")


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
        MoEModel("deepseek-v3", d_model=7168, d_expert=2048, moe_layers=58, total_layers=61,
                 routed_experts=256, top_k=8, shared_experts=1, default_dtype="fp8-b128",
                 source="deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, "
                        "moe_intermediate_size 2048, num_hidden_layers 61, first_k_dense_replace "
                        "3, n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, "
                        "quantization_config fp8 weight_block_size [128, 128]"),
        MoEModel("qwen3-235b-a22b", d_model=4096, d_expert=1536, moe_layers=94, total_layers=94,
                 routed_experts=128, top_k=8, shared_experts=0,
                 source="Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, "
                        "moe_intermediate_size 1536, num_hidden_layers 94 (every layer MoE), "
                        "num_experts 128, num_experts_per_tok 8; released in bf16"),
        MoEModel("gpt-oss-120b", d_model=2880, d_expert=2880, moe_layers=36, total_layers=36,
                 routed_experts=128, top_k=4, shared_experts=0, default_dtype="mxfp4",
                 source="openai/gpt-oss-120b config.json: hidden_size 2880, intermediate_size "
                        "2880, num_hidden_layers 36, num_local_experts 128, "
                        "num_experts_per_tok 4, quantization_config mxfp4 (expert weights)"),
    )
}


def resolve_model(text: str) -> tuple[MoEModel, str]:
    """``"mixtral-8x7b"`` or ``"mixtral-8x7b:fp8"`` -> ``(model, dtype)``; no dtype: the model's
    released format (raises ValueError)."""
    name, _, dtype = str(text).partition(":")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODELS)} "
                         f"(or give --expert-bytes)")
    dtype = dtype or MODELS[name].default_dtype
    MODELS[name].expert_bytes(dtype)  # validates the dtype
    return MODELS[name], dtype
