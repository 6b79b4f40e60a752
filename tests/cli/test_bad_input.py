"""Bad model files get one clear line from the CLI, never a traceback."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest


def hf2q(*args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "hf2q.cli", *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def write_gguf(path, arch: str, tensors: dict):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_clean_error(code, err, *needles):
    assert code == 1
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("command", ["info", "generate"])
def test_missing_file(tmp_path, command):
    path = tmp_path / "nope.gguf"
    args = [command, str(path)] if command == "info" else [command, "--model", str(path), "--prompt", "hi"]
    code, _, err = hf2q(*args)
    assert_clean_error(code, err, f"Model not found: {path}")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    code, _, err = hf2q("info", str(path))
    assert_clean_error(code, err, "Not a GGUF file", str(path))


def test_truncated_file(tmp_path, gguf_dense_f32):
    data = open(gguf_dense_f32, "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    code, _, err = hf2q("info", str(path))
    assert_clean_error(code, err, str(path))
    assert "truncated" in err.lower()


@pytest.mark.parametrize("size", [20, 4096])
def test_header_cut_short(tmp_path, gguf_dense_f32, size):
    """The message names the file and what is wrong, never the reader's numpy errors."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(open(gguf_dense_f32, "rb").read()[:size])
    code, _, err = hf2q("info", str(path))
    assert_clean_error(code, err, str(path), "truncated")
    for internal in ("index", "axis", "dtype", "numpy"):
        assert internal not in err, err


def test_serve_truncated_file(tmp_path, gguf_dense_f32):
    path = tmp_path / "cut.gguf"
    path.write_bytes(open(gguf_dense_f32, "rb").read()[:4096])
    from tests.e2e.conftest import free_port

    code, _, err = hf2q("serve", "--model", str(path), "--port", str(free_port()))
    assert_clean_error(code, err, str(path), "truncated")
    assert "index" not in err and "axis" not in err


def test_serve_port_out_of_range():
    """`python -m hf2q` is the command; a port getaddrinfo would wrap (99999 -> 34463) is refused."""
    proc = subprocess.run([sys.executable, "-m", "hf2q", "serve", "--port", "99999"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "99999 is not a port number: use 1-65535" in proc.stderr


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", "llama", {"x": (np.zeros(32, dtype=np.float32), None)})
    code, _, err = hf2q("info", str(path))
    assert_clean_error(code, err, "unsupported architecture 'llama'")


def test_unsupported_tensor_type(tmp_path):
    import gguf

    q2k = np.zeros((1, 84), dtype=np.uint8)  # one Q2_K super-block of 256 weights
    path = write_gguf(tmp_path / "q2k.gguf", "qwen35", {"blk.0.ffn_up.weight": (q2k, gguf.GGMLQuantizationType.Q2_K)})
    code, _, err = hf2q("info", str(path))
    assert_clean_error(code, err, "Unsupported tensor type Q2_K", "blk.0.ffn_up.weight")


def test_cuda_device_without_cuda_is_a_clean_error(gguf_dense_f32):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = hf2q("generate", "--model", str(gguf_dense_f32), "--prompt", "hi", "--device", "cuda")
    assert_clean_error(code, err, "CUDA is not available")
