"""hf2q: an OpenAI-compatible inference server for Qwen3.5 / Qwen3.6 hybrid models from GGUF files."""
from hf2q.model import Model, load

__all__ = ["Model", "load"]
__version__ = "0.1.0"
