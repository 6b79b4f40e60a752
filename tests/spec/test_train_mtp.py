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
from hf2q.kernels.gdn import ops as gdn_ops
from hf2q.kernels.gdn.chunked_naive import chunk_gdn_naive, fla_backward_refused
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
    # the forwards packed no trained projection into a copy outside autograd (the optimizer's Parameters stay)
    assert all(p.requires_grad for p in net.parameters())


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
        assert row["first_differences"] == []
    plain = [int(t) for t in loaded.net.logits(ids).argmax(-1)[-1:]] + [5, 6]
    got = plain[:1] + [7, 6]
    gap = spec_eval.divergence(loaded, ids, got, plain)
    top = loaded.net.logits(ids + plain[:1])[-1].topk(2).values
    assert gap == {"position": 1, "token": 7, "plain_token": 5, "top2_gap": round(float(top[0] - top[1]), 4)}


@pytest.fixture(scope="module")
def fla_naive():
    """fla's PyTorch chunked delta rule, or a skip: fla is a GPU extra, absent from the CPU test environment."""
    return pytest.importorskip("fla.ops.gated_delta_rule.naive",
                               reason="fla (the gpu extra) is not installed: the naive chunked rule is fla's")


def test_naive_chunked_rule_matches_the_reference(fla_naive):
    """Through `chunk_gdn`'s contract (raw q/k, grouped value heads, sequences of unequal lengths laid end to end,
    one over a chunk of 64, nonzero initial states), fla's chunked form gives the token-by-token reference's
    outputs, final states and input gradients within fp32 rounding (the two sum in different orders)."""
    gen = torch.Generator().manual_seed(0)
    lens, nk, nv, dk, dv = [5, 70, 13], 2, 4, 16, 8
    t = sum(lens)
    inputs = [torch.randn(t, nk, dk, generator=gen), torch.randn(t, nk, dk, generator=gen),
              torch.randn(t, nv, dv, generator=gen), -2 * torch.rand(t, nv, generator=gen),
              torch.rand(t, nv, generator=gen), torch.randn(len(lens), nv, dk, dv, generator=gen)]
    cu = torch.tensor([0, 5, 75, 88])
    weights = torch.randn(t, nv, dv, generator=gen), torch.randn(len(lens), nv, dk, dv, generator=gen)
    results = []
    for rule in (gdn_ops.chunk_gdn, chunk_gdn_naive):
        leaves = [x.clone().requires_grad_() for x in inputs]
        q, k, v, g, beta, state = leaves
        o, final = rule(q, k, v, g, beta, state, cu, lens, dk ** -0.5, 1e-6)
        grads = torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), leaves)
        results.append([o.detach(), final.detach(), *grads])
    for ref, naive in zip(*results):
        torch.testing.assert_close(naive, ref, rtol=1e-4, atol=1e-5)


def test_naive_training_step_matches_the_reference(train_mtp, fla_naive):
    """`--gdn naive` trains what the reference trains: on the tiny shape (a batch of two windows), both losses
    and every parameter's gradient equal the reference path's within fp32 rounding (seen: 1e-5 of the norm)."""
    net = train_mtp.build_model(train_mtp.model_config(train_mtp.hf_config(train_mtp.SIZES["tiny"])), seed=1, std=0.1)
    ids = torch.randint(0, 5000, (2, 40), generator=torch.Generator().manual_seed(0))
    runs = []
    with fast_path("off"):
        for rule in ("kernel", "naive"):
            net.zero_grad(set_to_none=True)
            main, mtp, _ = train_mtp.losses(net, ids, train_mtp.DELTA_RULES[rule])
            (main + train_mtp.MTP_WEIGHT * mtp).backward()
            runs.append((main.detach(), mtp.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}))
    (ref_main, ref_mtp, ref_grads), (main, mtp, grads) = runs
    torch.testing.assert_close(main, ref_main, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mtp, ref_mtp, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).norm() <= 1e-4 * grad.norm(), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_step_on_cuda_matches_cpu(train_mtp):
    """On CUDA the DeltaNet goes through what `--gdn auto` picks: fla's chunked kernel (forward and backward),
    or, where fla refuses its gated backward (Hopper with Triton < 3.7.1), fla's PyTorch chunked form; the
    test says which by asserting it (and, on the naive path, that fla's kernel does refuse). The losses match
    the CPU reference's, and every parameter gets a finite gradient near the reference's."""
    net = train_mtp.build_model(train_mtp.model_config(train_mtp.hf_config(train_mtp.SIZES["tiny"])), seed=1, std=0.1)
    ids = torch.randint(0, 5000, (3, 40), generator=torch.Generator().manual_seed(0))
    rule = train_mtp.choose_delta_rule("auto", "cuda")
    assert rule == ("naive" if fla_backward_refused() else "kernel")
    delta_rule = train_mtp.DELTA_RULES[rule]
    with fast_path("off"):
        cpu = train_mtp.losses(net, ids)
        (cpu[0] + cpu[1]).backward()
        cpu_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        net.zero_grad(set_to_none=True)
        net.cuda()
        if rule == "naive":
            with pytest.raises(RuntimeError, match="chunk_bwd_dqkwg"):
                sum(train_mtp.losses(net, ids.cuda())[:2]).backward()
            net.zero_grad(set_to_none=True)
        gpu = train_mtp.losses(net, ids.cuda(), delta_rule)
        (gpu[0] + gpu[1]).backward()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):  # how train() runs on CUDA
            mixed = train_mtp.losses(net, ids.cuda(), delta_rule)
    for a, b, c in zip(cpu[:2], gpu[:2], mixed[:2]):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(c.float().cpu(), a.detach(), rtol=3e-2, atol=3e-2)
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        # relative to the gradient's norm: the kernels' TF32 products and summation order, not a wrong rule
        assert (p.grad.cpu() - cpu_grads[name]).norm() <= 2e-2 * cpu_grads[name].norm() + 1e-6, name
