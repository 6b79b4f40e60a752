"""hf2q: an OpenAI-compatible inference server for Qwen3.5 / Qwen3.6 hybrid models from GGUF files."""
__all__ = ["Model", "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`hf2q.load` and `hf2q.Model` import the model, and torch with it, when first asked for: the `hf2q`
    command then parses its flags and prints its help without waiting seconds for them."""
    if name in __all__:
        from hf2q import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
