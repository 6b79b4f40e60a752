"""Suite-wide fixtures; their logic lives in tests/support/fixtures.py.

The tiny fixture models gain nothing from intra-op threads, and on a 2-core machine running the test
process and a server process side by side, spinning OpenMP threads make every small op many times slower:
tests and the servers they start use one thread each.
"""
import os

os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("TRITON_INTERPRET") == "1":  # the kernel tests' interpreter children
    from tests.support.triton_interpreter import patch_once_per_launch

    patch_once_per_launch()
from tests.support.fixtures import (  # noqa: F401  (pytest finds fixtures by name here)
    gguf_dense_bf16, gguf_dense_f32, gguf_dense_q4_k_m, gguf_dense_q8_0, gguf_moe_f32, gguf_moe_q4_k_m, gguf_moe_q8_0,
    hf_dense_dir, hf_model_dense, hf_model_moe, hf_moe_dir,
)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only every N-th selected test, from the I-th (0-based): the interpreter children of "
                          "tests/support/triton_targets.py split a file over the machine's cores this way")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs, so the shards are even
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard:
        index, count = (int(v) for v in shard.split("/"))
        config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % count != index])
        items[:] = [item for k, item in enumerate(items) if k % count == index]


def pytest_collection_finish(session):
    """Start the Triton interpreter children of the selected kernel tests now (tests/support/triton_targets.py)."""
    from tests.support import triton_targets

    runs = [item.function.interpreter_run for item in session.items
            if hasattr(getattr(item, "function", None), "interpreter_run")
            and not any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))]
    if runs and not session.config.option.collectonly:
        triton_targets.start_in_background(runs, alone=len(runs) == len(session.items))


def pytest_sessionfinish(session):
    from tests.support import triton_targets

    triton_targets.stop_background()
