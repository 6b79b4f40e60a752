"""Our GGUF forward pass against HF transformers (fp32, CPU) on tiny random checkpoints."""
from __future__ import annotations

import pytest
import torch

import hf2q
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.sampling_params import SamplingParams

PROMPT = [9707, 11, 1879, 0, 151644, 35946, 4340, 220, 16, 17, 18, 248045, 846, 198, 3838, 374, 264, 1273, 30]


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def hf_logits(hf_model, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def dense(gguf_dense_f32):
    return hf2q.load(gguf_dense_f32)


@pytest.fixture(scope="module")
def moe(gguf_moe_f32):
    return hf2q.load(gguf_moe_f32)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_match_hf_fp32(kind, request):
    model = request.getfixturevalue(kind)
    hf_model = request.getfixturevalue(f"hf_model_{kind}")
    ours, ref = model.logits(PROMPT), hf_logits(hf_model, PROMPT)
    assert ours.shape == ref.shape
    assert rel_error(ours, ref) <= 1e-5
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def greedy_engine_tokens(model, prompt, n) -> list[int]:
    engine = Engine(model, EngineConfig(max_model_len=512))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [t for out in engine.generate(prompt, params) for t in out.new_token_ids]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_48_tokens_match_hf_generate(kind, request):
    model = request.getfixturevalue(kind)
    hf_model = request.getfixturevalue(f"hf_model_{kind}")
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                eos_token_id=None)[0, len(PROMPT):].tolist()
    assert len(ref) == 48
    assert len(set(ref)) > 4, "fixture too degenerate to tell paths apart"
    assert greedy_engine_tokens(model, PROMPT, 48) == ref


# Quantized files: the logits error (max |diff| / max |ref|) against fp32 HF is bounded. Measured on the
# fixtures: bf16 < 2e-2, Q8_0 0.057 (dense) and 0.072 (MoE); random weights amplify rounding layer by layer.
QUANT_BOUNDS = {"gguf_dense_bf16": 2e-2, "gguf_dense_q8_0": 0.1, "gguf_moe_q8_0": 0.1}


@pytest.mark.parametrize("fixture", sorted(QUANT_BOUNDS))
def test_quantized_logits_within_bounds(fixture, request):
    kind = "moe" if "moe" in fixture else "dense"
    model = hf2q.load(request.getfixturevalue(fixture))
    ref = hf_logits(request.getfixturevalue(f"hf_model_{kind}"), PROMPT)
    err = rel_error(model.logits(PROMPT), ref)
    assert 0 < err <= QUANT_BOUNDS[fixture]


def hf_mtp_reference(hf_model, hf_dir, ids) -> torch.Tensor:
    """MTP logits computed independently from the checkpoint's `mtp.*` weights with HF's own modules."""
    from safetensors.torch import load_file

    mtp = load_file(str(hf_dir / "mtp.safetensors"))
    cfg = hf_model.config
    layer_cls = type(hf_model.model.layers[cfg.layer_types.index("full_attention")])
    layer = layer_cls(cfg, cfg.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})
    eps = cfg.rms_norm_eps

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    ids_t = torch.tensor([ids])
    with torch.no_grad():
        hidden = hf_model.model(ids_t).last_hidden_state[0]  # after the final norm
        emb = hf_model.model.embed_tokens(ids_t[:, 1:])[0]
        x = torch.cat((norm(emb, mtp["mtp.pre_fc_norm_embedding.weight"]),
                       norm(hidden[:-1], mtp["mtp.pre_fc_norm_hidden.weight"])), dim=-1) @ mtp["mtp.fc.weight"].T
        n = x.shape[0]
        pos = torch.arange(n)[None]
        pos_emb = hf_model.model.rotary_emb(x[None], pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        layer.self_attn.config._attn_implementation = "eager"
        y = layer(x[None], position_embeddings=pos_emb, attention_mask=mask, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return hf_model.lm_head(norm(y[0], mtp["mtp.norm.weight"])).float()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_logits_match_independent_computation(kind, request):
    model = request.getfixturevalue(kind)
    ref = hf_mtp_reference(request.getfixturevalue(f"hf_model_{kind}"), request.getfixturevalue(f"hf_{kind}_dir"),
                           PROMPT)
    ours = model.mtp_logits(PROMPT)
    assert ours.shape == ref.shape == (len(PROMPT) - 1, model.config.vocab_size)
    assert rel_error(ours, ref) <= 1e-5
