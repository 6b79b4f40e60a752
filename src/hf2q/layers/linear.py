"""Bias-free linear projection; the one place a weight format (dense or quantized) is multiplied."""
from __future__ import annotations

import torch
from torch import nn

from hf2q.kernels.linear import ops as linear_ops


class Linear(nn.Module):
    """y = x Wᵀ with W either a dense parameter or GGUF blocks kept as bytes (`qweight`, uint8
    [out, row_bytes], type `qtype`): the fast path multiplies the blocks without dequantizing W."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.register_buffer("qweight", None)
        self.qtype: str | None = None
        # the blocks dequantized, kept beside them for products of many rows (`kernels.linear.ops.keep_dense`)
        self.register_buffer("dense", None, persistent=False)

    @property
    def quantized(self) -> bool:
        return self.qweight is not None

    def set_quantized(self, raw: torch.Tensor, qtype: str) -> None:
        """Hold `raw` blocks of `qtype` instead of a dense weight (the dense parameter is dropped)."""
        from hf2q.kernels.quant.ops import check_raw

        check_raw(raw, qtype, (self.out_features, self.in_features))
        del self.weight
        self.register_parameter("weight", None)
        self.qweight = raw
        self.qtype = qtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return linear_ops.linear(x, self.weight)
        columns = linear_ops.kept_columns([self])
        if linear_ops.columns_serve(x, columns):
            return linear_ops.columns_linear(x, columns)
        if linear_ops.dense_serves(x, self.dense):
            return linear_ops.linear(x, self.dense)
        from hf2q.kernels.quant.ops import quant_linear

        return quant_linear(x, self.qweight, self.qtype, self.out_features)

    def extra_repr(self) -> str:
        kind = f", {self.qtype}" if self.quantized else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{kind}"
