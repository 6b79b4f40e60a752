"""`hf2q bench --quant` models: random GGUF blocks of a llama.cpp-style mix on real module shapes, their
weight bytes, and the fast path over them (packed projections of one type, one by one across types)."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from hf2q.bench import decode_ceiling, prefill_ceiling
from hf2q.bench_shapes import SHAPES, matrix_elems, quant_plan, random_quant_model, tiny_config, weight_bytes
from hf2q.kernels.choose import fast_path
from hf2q.models.qwen35 import Qwen35Model
from hf2q.quant import dequantize_ref


def cfg(moe: bool):  # every projection's input a multiple of 256 (K-quant super-blocks)
    return dataclasses.replace(tiny_config(moe), hidden_size=256, head_dim=64, linear_v_head_dim=64,
                               linear_k_head_dim=64, intermediate_size=0 if moe else 512,
                               moe_intermediate_size=256 if moe else 0,
                               shared_expert_intermediate_size=256 if moe else 0)


def test_q4_k_m_plan_of_the_9b_shape_follows_llama_cpp():
    with torch.device("meta"):
        net = Qwen35Model(SHAPES["9b"][0])
    plan = {id(m): q for m, _, q in quant_plan(net, "q4_k_m")}
    assert plan[id(net.lm_head)] == "Q6_K"
    downs = [plan[id(layer.ffn.down)] for layer in net.layers]
    assert downs[:4] == ["Q6_K"] * 4 and downs[-4:] == ["Q6_K"] * 4 and downs[4:7] == ["Q4_K", "Q4_K", "Q6_K"]
    assert {plan[id(layer.mixer.qkv)] for layer in net.layers if not layer.is_full_attention} == {"Q5_K"}
    assert {plan[id(layer.mixer.v)] for layer in net.layers if layer.is_full_attention} == {"Q6_K", "Q4_K"}
    assert Counter(plan.values())["Q4_K"] > len(plan) / 2


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_random_quant_model_runs_and_counts_block_bytes(mix, moe):
    net = random_quant_model(cfg(moe), mix, device="cpu", dtype=torch.float32, std=0.08)
    plan = quant_plan(net, mix)
    assert all(m.quantized if stack is None else m.exps_qtype[stack] == q for m, stack, q in plan)
    raw = sum((m.quant_stack(s)[0] if s else m.qweight).numel() for m, s, _ in plan)
    dense = sum(p.numel() * p.element_size() for n, p in net.named_parameters() if n != "embed")
    assert weight_bytes(net) == raw + dense
    if mix == "q4_k_m":  # about 4.5-6.5 bits per weight
        assert 0.5 < raw / matrix_elems(net) < 0.85
    values = dequantize_ref(net.lm_head.qweight, net.lm_head.qtype, (net.config.vocab_size, 256))
    assert 0.02 < float(values.std()) < 0.2  # sane scales, as the bench needs
    ids = torch.randint(0, net.config.vocab_size, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = net.logits(ids)
    assert torch.isfinite(ref).all() and float(ref.std()) > 0.1
    with fast_path("force"):
        got = net.logits(ids)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert decode_ceiling(net, net.config, 1, 64, 1e12) > 0 and prefill_ceiling(net, net.config, 64, 1e12) > 0


def test_quant_plan_rejects_unknown_mix():
    with torch.device("meta"):
        net = Qwen35Model(tiny_config())
    with pytest.raises(ValueError):
        quant_plan(net, "q3_k_s")


def test_dense_copy_flags_without_what_they_act_on_are_refused(capsys):
    """`hf2q bench --batched-weights dense` without `--quant` would copy nothing, `--dense-rows` without the copies
    would change nothing: refused by name, not ignored."""
    from hf2q.bench import main

    assert main(["--batched-weights", "dense"]) == 2
    assert "--quant" in capsys.readouterr().out
    assert main(["--quant", "q4_k_m", "--dense-rows", "8"]) == 2
    assert "--batched-weights dense" in capsys.readouterr().out
    assert main(["--quant", "q4_k_m", "--batched-weights", "dense", "--dense-rows", "0"]) == 2
    assert "at least 1" in capsys.readouterr().out
