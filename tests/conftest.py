"""Suite-wide fixtures; their logic lives in tests/support/fixtures.py."""
from tests.support.fixtures import (  # noqa: F401  (pytest finds fixtures by name here)
    gguf_dense_bf16, gguf_dense_f32, gguf_dense_q8_0, gguf_moe_f32, gguf_moe_q8_0, hf_dense_dir, hf_model_dense,
    hf_model_moe, hf_moe_dir,
)
