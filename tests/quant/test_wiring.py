"""Quantized weights through the whole model: packed projections on the fast path, the LM head, MoE
expert stacks, and `hf2q.load`'s per-device default. On CPU the kept blocks go through the exact gguf
reference, so a kept-quantized model must give the dequantized model's logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch

import hf2q
from hf2q.cache.hybrid import HybridCache
from hf2q.checkpoint.gguf_file import GGUFFile
from hf2q.checkpoint.loader import build_model
from hf2q.config import CacheConfig, ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels.choose import fast_path
from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.linear.ops import packed_linear
from hf2q.kernels.moe import ops as moe_ops
from hf2q.kernels.quant import moe as quant_moe
from hf2q.layers.linear import Linear
from hf2q.layers.moe import EXPERT_STACKS, MoE
from hf2q.quant import dequantize_ref, keep_blocks, random_blocks

PROMPT = [1, 5, 9, 200, 17, 3, 88, 41]
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * torch.cuda.is_available()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def load(path, keep_quantized: bool, device="cpu", dtype=torch.float32):
    gguf = GGUFFile(path)
    cfg = ModelConfig.from_gguf_metadata(gguf.metadata)
    return build_model(gguf, cfg, device=device, dtype=dtype, with_mtp=False, keep_quantized=keep_quantized)


@torch.inference_mode()
def greedy_cached(net, n: int, logits: list | None = None) -> list[int]:
    """Greedy decoding through the paged cache: one prefill, then one token per step (each step's logits,
    on the CPU in fp32, appended to `logits` if given)."""
    cache = HybridCache(net.config, CacheConfig(num_slots=1, num_blocks=16, block_size=4),
                        device=net.embed.device)
    slot = cache.acquire()
    ids, out, done = list(PROMPT), [], 0
    for _ in range(n):
        cache.reserve(slot, len(ids))
        batch = ForwardBatch.single(ids[done:], start=done, slot=slot, cache=cache, device=net.embed.device)
        last = net.compute_logits(net(batch)[-1:])
        if logits is not None:
            logits.append(last.float().cpu())
        nxt = int(last.argmax())
        cache.commit(slot, len(ids))
        done = len(ids)
        ids.append(nxt)
        out.append(nxt)
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def twins(request):
    path = request.getfixturevalue(f"gguf_{request.param}_q8_0")
    return load(path, False), load(path, True)


def test_fixture_keeps_projections_head_and_experts_as_blocks(twins):
    _, kept = twins
    assert kept.lm_head.quantized and kept.lm_head.qtype == "Q8_0"
    projections = [getattr(layer.mixer, 'o' if layer.is_full_attention else 'out') for layer in kept.layers]
    assert all(p.quantized for p in projections)
    moes = [layer.ffn for layer in kept.layers if isinstance(layer.ffn, MoE)]
    assert all(m.quantized and m.gate_exps is None for m in moes)
    assert not any(isinstance(m, Linear) and m.quantized for m in twins[0].modules())


def test_fast_path_logits_of_kept_blocks_equal_dequantized(twins):
    dense, kept = twins
    ref = dense.logits(PROMPT)
    with fast_path("force"):
        assert rel(kept.logits(PROMPT), ref) <= 1e-5
    assert rel(kept.logits(PROMPT), ref) <= 1e-5  # the per-module exact path too


def test_fast_path_greedy_tokens_of_kept_blocks_equal_dequantized(twins):
    dense, kept = twins
    want = greedy_cached(dense, 16)
    with fast_path("force"):
        assert greedy_cached(kept, 16) == want


class Built(Exception):
    pass


@pytest.mark.parametrize("device, asked, kept", [("cpu", None, False), ("cuda", None, True), ("cuda", False, False)])
def test_load_keeps_blocks_on_cuda_by_default(gguf_dense_q8_0, monkeypatch, device, asked, kept):
    def build(*args, keep_quantized, **kw):
        raise Built(keep_quantized)

    monkeypatch.setattr("hf2q.checkpoint.loader.build_model", build)
    with pytest.raises(Built) as got:
        hf2q.load(gguf_dense_q8_0, device=device, with_mtp=False, keep_quantized=asked)
    assert got.value.args == (kept,)


# ---- packed projections ------------------------------------------------------------------------------
def linears(qtypes, k=256, rows=(64, 32, 8), seed=0):
    """Quantized Linears (None: dense) and their dequantized dense twins."""
    kept, dense = [], []
    for i, (n, qtype) in enumerate(zip(rows, qtypes)):
        d, q = Linear(k, n), Linear(k, n)
        raw = random_blocks(qtype or "Q8_0", n, k, std=0.05, seed=seed + i)
        d.weight.data = dequantize_ref(raw, qtype or "Q8_0", (n, k))
        if qtype is None:
            q.weight.data = d.weight.data.clone()
        else:
            q.set_quantized(raw, qtype)
        kept.append(q)
        dense.append(d)
    return kept, dense


@pytest.mark.parametrize("qtypes", [("Q4_K", "Q4_K", "Q4_K"), ("Q4_K", "Q6_K", "Q4_K"), ("Q8_0", None, "Q8_0"),
                                    (None, "Q4_K", None)])
def test_packed_linear_with_quantized_projections(qtypes):
    kept, dense = linears(qtypes)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    got = packed_linear(x, kept)
    for y, d in zip(got, dense):
        assert y.shape == (5, d.out_features)
        assert rel(y, d(x)) <= 1e-5
    if len(set(qtypes)) == 1:  # one packed block matrix, each Linear's blocks a view of it
        packed = kept[0]._qpacked
        assert packed.shape[0] == sum(d.out_features for d in dense)
        assert kept[1].qweight.data_ptr() == packed[64:].data_ptr()
        assert all(rel(a, b) == 0 for a, b in zip(packed_linear(x, kept), got))
    if qtypes == (None, "Q4_K", None):  # a MoE's float router and shared gate: one product, not two
        packed = kept[0]._packed
        assert packed.shape[0] == 64 + 8
        assert kept[2].weight.data_ptr() == packed[64:].data_ptr()


# ---- MoE experts -------------------------------------------------------------------------------------
def moe_twins(qtypes, device):
    hidden, inter, n_exp = 256, 256, 8
    dense, kept = MoE(hidden, n_exp, 2, inter, 0), MoE(hidden, n_exp, 2, inter, 0)
    router = torch.randn(n_exp, hidden, generator=torch.Generator().manual_seed(5)) * 0.1
    dense.router.weight.data, kept.router.weight.data = router.clone(), router.clone()
    blocks = []
    for i, (name, qtype) in enumerate(zip(EXPERT_STACKS, qtypes)):
        shape = dense.stack_shape(name)
        raw = random_blocks(qtype, shape[0] * shape[1], shape[2], std=0.05, seed=10 + i).view(*shape[:2], -1)
        getattr(dense, name).data = dequantize_ref(raw, qtype, shape)
        blocks.append((name, raw.contiguous(), qtype))
    dense, kept = dense.to(device), kept.to(device)
    for name, raw, qtype in blocks:  # laid out for the device as a loaded model's are
        kept.set_quantized(name, keep_blocks(raw, qtype, device), qtype)
    return dense, kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [3, 600])  # few pairs: chosen experts' blocks; many: dequantized stacks
def test_quantized_moe_experts_equal_dense_loop(device, tokens):
    dense, kept = moe_twins(("Q4_K", "Q4_K", "Q6_K"), device)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(6)).to(device)
    ref = dense(x)
    assert kept.quantized
    tol = 1e-5 if device == "cpu" else 2e-2  # CUDA: bf16, and int8 activations for few pairs
    assert rel(kept(x), ref) <= tol
    weights, experts = kept.route(x)
    direct = moe_ops.moe_combine(quant_moe.moe_expert_pairs_quant(x, experts,
                                                                  *(kept.quant_stack(n) for n in EXPERT_STACKS)),
                                  weights)
    assert rel(direct, ref) <= tol


def test_partly_quantized_moe_uses_exact_dense_stacks():
    dense, kept = moe_twins(("Q4_K", "Q4_K", "Q6_K"), "cpu")
    mixed = MoE(256, 8, 2, 256, 0)
    mixed.router.weight.data = dense.router.weight.data.clone()
    mixed.gate_exps.data = dense.gate_exps.data.clone()
    mixed.up_exps.data = dense.up_exps.data.clone()
    mixed.set_quantized("down_exps", *kept.quant_stack("down_exps"))
    assert not mixed.quantized
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(8))
    assert rel(mixed(x), dense(x)) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gpu_default_load_keeps_blocks_and_greedy_matches(kind, request):
    """CUDA load keeps blocks by default; bf16 greedy tokens match the dequantized file's, or the first
    difference is at a near-tie (of the logits, or of an MoE router's choice)."""
    from tests.quant.test_model import assert_routed_divergence_explained
    path = request.getfixturevalue(f"gguf_{kind}_q8_0")
    kept = hf2q.load(path, device="cuda", dtype=torch.bfloat16, with_mtp=False).net
    dense = load(path, False, "cuda", torch.bfloat16)
    assert kept.lm_head.quantized
    a, b = greedy_cached(dense, 32), greedy_cached(kept, 32)
    if a != b:
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert_routed_divergence_explained(dense, kept, PROMPT + a[:first], first, dense_mode="auto", tie_share=0.02)


# ---- dense copies for many rows (`hf2q serve --batched-weights dense`) -------------------------------------
def quant_products(monkeypatch) -> list[int]:
    """The row counts of every product that reads quantized blocks from here on."""
    from hf2q.kernels.quant import ops as quant_ops

    rows, real = [], quant_ops.quant_linear

    def spy(x, *args, **kw):
        rows.append(x.numel() // x.shape[-1])
        return real(x, *args, **kw)

    monkeypatch.setattr(quant_ops, "quant_linear", spy)
    return rows


@pytest.mark.parametrize("qtypes", [("Q4_K", "Q4_K", "Q4_K"), ("Q4_K", "Q6_K", "Q4_K"), (None, "Q8_0", None)])
def test_packed_linear_multiplies_dense_copies_from_dense_rows(qtypes, monkeypatch):
    from hf2q.kernels.linear.ops import DENSE_ROWS, keep_dense, pack

    kept, dense = linears(qtypes)
    pack(kept)
    kept_bytes = keep_dense(kept, torch.float32)
    assert kept_bytes == 4 * 256 * sum(d.out_features for d, q in zip(dense, qtypes) if q is not None)
    assert all((lin.dense is None) == (q is None) for lin, q in zip(kept, qtypes))
    if qtypes[0] == qtypes[1] == qtypes[2]:  # one copy for the pack, each projection's a view of its rows
        assert kept[1].dense.data_ptr() == kept[0]._dpacked[64:].data_ptr()
    if None not in qtypes and len(set(qtypes)) > 1:  # several types: one copy for all of them too
        assert kept[1].dense.data_ptr() == kept[0]._dpacked[64:].data_ptr()
    rows = quant_products(monkeypatch)
    gemms, real_linear = [], linear_ops.linear
    monkeypatch.setattr(linear_ops, "linear", lambda x, w, *a: gemms.append(w.shape[0]) or real_linear(x, w, *a))
    for m in (DENSE_ROWS, 4):
        gemms.clear()
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        got = packed_linear(x, kept)
        if m == DENSE_ROWS and None not in qtypes:  # the whole pack in one product, as a dense file's
            assert gemms == [104]
        for y, d in zip(got, dense):
            assert rel(y, d(x)) <= 1e-5
        for lin, d in zip(kept, dense):  # each projection alone as well
            assert rel(lin(x), d(x)) <= 1e-5
    assert rows and all(r == 4 for r in rows)  # the blocks serve the few rows only


def test_model_with_dense_copies_gives_the_logits_of_its_blocks(gguf_dense_q8_0, gguf_moe_q8_0, monkeypatch):
    """Every quantized projection of the dense and MoE fixtures gets its copy (MoE experts stay blocks); a
    24-row forward then multiplies the copies, never the blocks, and gives the logits the blocks gave."""
    prompt = [(7 * i + 3) % 200 for i in range(24)]  # more rows than DENSE_ROWS
    for path in (gguf_dense_q8_0, gguf_moe_q8_0):
        kept = load(path, True)
        with fast_path("force"):
            want = kept.logits(prompt)
        quantized = [m for m in kept.modules() if isinstance(m, Linear) and m.quantized]
        assert kept.keep_dense_weights(torch.float32) == 4 * sum(m.out_features * m.in_features for m in quantized)
        assert all(m.dense is not None for m in quantized)
        assert all(m.quantized and m.gate_exps is None for m in kept.modules() if isinstance(m, MoE))
        rows = quant_products(monkeypatch)
        with fast_path("force"):
            assert rel(kept.logits(prompt), want) <= 1e-6
        assert rel(kept.logits(prompt), want) <= 1e-5  # the per-module exact path too
        assert rows == []  # no product read the blocks
        monkeypatch.undo()


def test_model_lays_out_every_q4_k_projection_by_column(gguf_dense_q4_k_m):
    """`keep_column_weights` (hf2q serve --batched-weights columns) lays out every Q4_K projection once (a pack's
    Q4_K part together, the others alone; this tiny file's Q4_K projections are its MLPs' down projections, outside
    packs: a pack's layout is tested in tests/quant/test_kernels.py), none of another type; each layout holds
    exactly the blocks' values."""
    from hf2q.kernels.linear.ops import kept_columns
    from hf2q.kernels.quant.q4k_columns import dequantize

    net = load(gguf_dense_q4_k_m, True)
    kept = net.keep_column_weights()
    covered = {}
    for layer in net.layers:
        for group in layer.mixer.packs + layer.ffn.packs:
            part = [lin for lin in group if lin.qtype == "Q4_K"]
            if part:
                covered.update({id(lin): (part, kept_columns(part)) for lin in part})
    for module in net.modules():
        if isinstance(module, Linear) and module.qtype == "Q4_K" and id(module) not in covered:
            covered[id(module)] = ([module], kept_columns([module]))
    layouts = {id(cols): (part, cols) for part, cols in covered.values()}
    assert covered and all(cols is not None for _, cols in covered.values())
    assert kept == sum(cols.nbytes for _, cols in layouts.values())
    for part, cols in layouts.values():
        want = torch.cat([dequantize_ref(lin.qweight, "Q4_K", (lin.out_features, lin.in_features)) for lin in part])
        assert torch.equal(dequantize(cols), want)
