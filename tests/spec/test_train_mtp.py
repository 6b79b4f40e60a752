"""tools/train_mtp.py and tools/spec_eval.py on the tiny shape: the training forward is the model's forward,
the written GGUF holds exactly the trained network (MTP head included), and speculation on it changes no
token. A few steps teach nothing, so no acceptance is asserted here."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import hf2q
from hf2q.kernels.choose import fast_path
from tests.support.tokenizer_dir import cached_tokenizer_dir

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    """tools/ is no package: load the module from its file."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_mtp():
    return load_tool("train_mtp")


def test_training_forward_is_the_models_forward(train_mtp):
    """Trunk and MTP logits of the differentiable training forward equal the inference path's
    (`Qwen35Model.logits`, `mtp_logits`), so what is trained is what is served."""
    net = train_mtp.build_model(train_mtp.model_config(train_mtp.hf_config(train_mtp.SIZES["tiny"])), seed=1, std=0.3)
    ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), fast_path("off"):
        hidden = train_mtp.trunk_forward(net, ids)
        rows = hidden.view(2, 12, -1)[:, :-1].reshape(-1, hidden.shape[-1])
        mtp = net.compute_logits(net.mtp(train_mtp.batch_of(ids[:, 1:]), rows, net)).view(2, 11, -1)
        logits = net.compute_logits(hidden).view(2, 12, -1)
        for i in range(2):
            torch.testing.assert_close(logits[i], net.logits(ids[i]), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mtp[i], net.mtp_logits(ids[i]), rtol=1e-4, atol=1e-4)


def test_train_write_load_and_speculate(train_mtp, tmp_path, capsys):
    out = tmp_path / "run"
    net, result = train_mtp.run(train_mtp.parse_args([
        "--tokenizer", str(cached_tokenizer_dir()), "--out", str(out), "--steps", "2", "--outtype", "f32",
        "--prompts", "2", "--prompt-chars", "200"]))
    assert result["steps"] == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in result["history"])
    heldout = json.loads((out / "heldout.json").read_text())
    assert len(heldout["code"]) == 2 and len(heldout["prose"]) == 2
    assert all(train_mtp.held_out(item["source"]) for items in heldout.values() for item in items)

    gguf = out / "model-f32.gguf"
    loaded = hf2q.load(gguf)
    assert loaded.net.mtp is not None
    ids = loaded.tokenizer.encode(heldout["code"][0]["text"])[:24]
    with torch.no_grad():
        torch.testing.assert_close(loaded.net.logits(ids), net.logits(ids), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(loaded.net.mtp_logits(ids), net.mtp_logits(ids), rtol=1e-4, atol=1e-4)

    spec_eval = load_tool("spec_eval")
    capsys.readouterr()
    status = spec_eval.main(["--model", str(gguf), "--prompts", str(out / "heldout.json"), "--limit", "1",
                             "--max-tokens", "8", "--modes", "mtp+ngram", "--k", "2", "--", "--spec-cost-window", "0"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["identical"]
    for kind in ("code", "prose"):
        assert report["kinds"][kind]["sample"]  # the start of the plain output, as text
        row = report["kinds"][kind]["mtp+ngram k=2"]
        assert row["identical"] and row["by_proposer"]["mtp"]["rounds"] > 0  # the head drafted, the engine verified


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_step_on_cuda_matches_cpu(train_mtp):
    """On CUDA the DeltaNet goes through fla's chunked kernel (forward and backward): the losses match the
    CPU reference's, and every parameter gets a finite gradient."""
    net = train_mtp.build_model(train_mtp.model_config(train_mtp.hf_config(train_mtp.SIZES["tiny"])), seed=1, std=0.1)
    ids = torch.randint(0, 5000, (3, 40), generator=torch.Generator().manual_seed(0))
    with fast_path("off"):
        with torch.no_grad():
            cpu = train_mtp.losses(net, ids)
        net.cuda()
        gpu = train_mtp.losses(net, ids.cuda())
        (gpu[0] + gpu[1]).backward()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):  # how train() runs on CUDA
            mixed = train_mtp.losses(net, ids.cuda())
    for a, b, c in zip(cpu[:2], gpu[:2], mixed[:2]):
        torch.testing.assert_close(b.cpu(), a, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(c.float().cpu(), a, rtol=3e-2, atol=3e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
