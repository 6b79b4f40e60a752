"""Train a small Qwen3.5 text model with its MTP head on the Python standard library, and write it as a GGUF.

    python tools/train_mtp.py --tokenizer TOK_DIR --out DIR [--size tiny|small] [--device cuda]
                              [--steps N] [--minutes M] [--outtype bf16|f32|q8_0] [--gdn auto|kernel|naive]

Random weights accept no drafts, so speculation's speed-up cannot be judged on them; this model's MTP drafts
are real. The text ships with every Python: the stdlib's `.py` files and `pydoc_data`'s topics (prose).
Held out (never trained on): every file or topic whose name's CRC-32 falls in bucket 0 of `HELD_OUT_BUCKETS`;
`DIR/heldout.json` holds prompts cut from them for `tools/spec_eval.py`.

The network is hf2q's own (`Qwen35Model`, `MTPHead`), so training and inference run the same layers. The MTP
loss is the standard one (DeepSeek-V3, Qwen3-Next): row t reads the trunk's hidden at t and the embedding of
token t + 1 and predicts token t + 2, exactly as `Qwen35Model.mtp_logits` runs the head. The DeltaNet layers
go through `gdn_ops.chunk_gdn` (fla's chunked kernel on CUDA, which has a backward; the reference on CPU), or,
where fla refuses its gated backward (Hopper with Triton older than 3.7.1) or `--gdn naive` asks, through fla's
PyTorch chunked form (`kernels/gdn/chunked_naive.py`), which autograd differentiates.
The result is saved in the HF layout (config.json + safetensors, MTP tensors under `mtp.*` as Qwen3.5
checkpoints name them) and converted with `hf2q convert`'s `convert`. Needs only torch on the device
(plus tokenizers, safetensors, gguf for the data and the files).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import shutil
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from hf2q.config import ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels.gdn import ops as gdn_ops
from hf2q.kernels.gdn.chunked_naive import chunk_gdn_naive, fla_backward_refused
from hf2q.kernels.choose import fast_path
from hf2q.kernels.norm import reference as norm_ref
from hf2q.models.qwen35 import DecoderLayer, Qwen35Model
from hf2q.models.qwen35_mtp import MTPHead

HELD_OUT_BUCKETS = 8  # a file or topic is held out when crc32(name) % HELD_OUT_BUCKETS == 0
VOCAB = 248320  # the Qwen3.5 embedding rows
EOS = 248044  # <|endoftext|>: separates documents
MTP_WEIGHT = 0.5
# The delta rules training can differentiate (`--gdn`): the serving path's chunked op, or fla's PyTorch chunked form
DELTA_RULES = {"kernel": gdn_ops.chunk_gdn, "naive": chunk_gdn_naive}

# Shapes: tiny for CI (seconds on a CPU), small for one H200 (about 35 M parameters besides the embedding).
SIZES = {
    "tiny": dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, linear_heads=2, linear_dim=32,
                 ffn=128, seq=32, batch=2, lr=3e-3, corpus_chars=50_000, eval_windows=4),
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, linear_heads=8, linear_dim=64,
                  ffn=1536, seq=512, batch=16, lr=2e-3, corpus_chars=None, eval_windows=16),
}


# ------------------------------------------------------------------------------------------------ text

def held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_BUCKETS == 0


def stdlib_documents() -> dict[str, list[tuple[str, str]]]:
    """(name, text) of every stdlib source file and pydoc topic, split into train / code / prose."""
    from pydoc_data.topics import topics

    root = Path(sysconfig.get_paths()["stdlib"])
    split: dict[str, list[tuple[str, str]]] = {"train": [], "code": [], "prose": []}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        split["code" if held_out(rel) else "train"].append((rel, text))
    for name in sorted(topics):
        split["prose" if held_out("topic:" + name) else "train"].append(("topic:" + name, topics[name]))
    return split


def prompts_from(docs: list[tuple[str, str]], count: int, chars: int) -> list[dict]:
    """`count` prompts of about `chars` characters, cut at a line start a third into each document."""
    out = []
    for name, text in docs:
        start = text.find("\n", len(text) // 3) + 1
        piece = text[start:start + chars]
        if len(piece) >= chars // 2 and piece.strip():
            out.append({"source": name, "text": piece[:piece.rfind("\n") + 1] or piece})
        if len(out) == count:
            break
    return out


def token_stream(tokenizer, docs: list[tuple[str, str]], max_chars: int | None) -> torch.Tensor:
    """Documents tokenized and laid end to end, each followed by <|endoftext|>."""
    texts, total = [], 0
    for _, text in docs:
        if max_chars is not None and total >= max_chars:
            break
        texts.append(text if max_chars is None else text[:max_chars - total])
        total += len(texts[-1])
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------- model

def hf_config(size: dict) -> dict:
    """config.json of the model, as a Qwen3.5 text checkpoint writes it (what `hf2q convert` reads)."""
    n = size["layers"]
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": VOCAB,
        "hidden_size": size["hidden"], "num_hidden_layers": n, "num_attention_heads": size["heads"],
        "num_key_value_heads": size["kv_heads"], "head_dim": size["head_dim"], "intermediate_size": size["ffn"],
        "linear_num_key_heads": size["linear_heads"], "linear_num_value_heads": size["linear_heads"],
        "linear_key_head_dim": size["linear_dim"], "linear_value_head_dim": size["linear_dim"],
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": _mrope_sections(size["head_dim"] // 8), "mrope_interleaved": True},
        "hidden_act": "silu", "mtp_num_hidden_layers": 1, "eos_token_id": 248046, "pad_token_id": EOS,
        "bos_token_id": None, "dtype": "float32",
    }


def _mrope_sections(half_rotary: int) -> list[int]:
    """Text, height and width shares of the rotary pairs, in Qwen3.5's proportions (11, 11, 10 of 32)."""
    share = round(half_rotary * 11 / 32)
    return [share, share, half_rotary - 2 * share]


def model_config(hf: dict) -> ModelConfig:
    rope = hf["rope_parameters"]
    return ModelConfig(
        arch="qwen35", hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_mtp_layers=1,
        num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"],
        rms_norm_eps=hf["rms_norm_eps"], context_length=hf["max_position_embeddings"],
        rope_theta=rope["rope_theta"], rotary_dim=int(hf["head_dim"] * rope["partial_rotary_factor"]),
        rope_sections=(*rope["mrope_section"], 0), full_attention_interval=hf["full_attention_interval"],
        linear_num_k_heads=hf["linear_num_key_heads"], linear_num_v_heads=hf["linear_num_value_heads"],
        linear_k_head_dim=hf["linear_key_head_dim"], linear_v_head_dim=hf["linear_value_head_dim"],
        conv_kernel=hf["linear_conv_kernel_dim"], vocab_size=hf["vocab_size"],
        intermediate_size=hf["intermediate_size"])


def build_model(cfg: ModelConfig, seed: int, std: float = 0.02) -> Qwen35Model:
    """A trainable network with the MTP head: matrices N(0, std) (the residual outputs scaled down by depth),
    norms 1, DeltaNet decay and step as Qwen3-Next initialises them."""
    gen = torch.Generator().manual_seed(seed)
    net = Qwen35Model(cfg, tie_embeddings=True)
    net.mtp = MTPHead(cfg, DecoderLayer(cfg, cfg.num_layers, net.rotary))
    with torch.no_grad():
        for name, p in net.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "conv":
                p.uniform_(-cfg.conv_kernel ** -0.5, cfg.conv_kernel ** -0.5, generator=gen)
            elif leaf == "a":  # -exp(A_log), A_log = log(U(1, 16))
                p.copy_(-(torch.rand(p.shape, generator=gen) * 15 + 1))
            elif leaf == "dt_bias":  # softplus⁻¹ of dt ~ logU(0.001, 0.1)
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(0.001))
                               + math.log(0.001))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif p.dim() >= 2:
                out_proj = name.endswith(("out.weight", "o.weight", "down.weight"))
                p.normal_(0.0, std / math.sqrt(2 * (cfg.num_layers + 1)) if out_proj else std, generator=gen)
            else:
                p.fill_(1.0)
    for p in net.parameters():
        p.requires_grad_(True)
    return net


def choose_delta_rule(choice: str, device) -> str:
    """The `DELTA_RULES` entry `--gdn CHOICE` trains with on `device`: `auto` takes `naive` on a CUDA device
    where fla refuses its gated chunked backward, else `kernel`."""
    if choice != "auto":
        return choice
    return "naive" if torch.device(device).type == "cuda" and fla_backward_refused() else "kernel"


def deltanet_forward(m, x: torch.Tensor, seqs: int, seq_len: int, delta_rule=gdn_ops.chunk_gdn) -> torch.Tensor:
    """`GatedDeltaNet.forward` of `seqs` fresh sequences of `seq_len` tokens, through differentiable kernels:
    the causal conv as a grouped conv1d, the delta rule through `delta_rule` (a `DELTA_RULES` value)."""
    t, channels = x.shape[0], m.conv.shape[0]
    mixed = m.qkv(x)
    conv = F.conv1d(mixed.view(seqs, seq_len, channels).transpose(1, 2), m.conv.to(mixed.dtype).unsqueeze(1),
                    padding=m.conv.shape[1] - 1, groups=channels)[..., :seq_len]
    conv = F.silu(conv).transpose(1, 2).reshape(t, channels)
    q, k, v = torch.split(conv, [m.nk * m.dk, m.nk * m.dk, m.nv * m.dv], dim=-1)
    g = m.a.float() * F.softplus(m.alpha(x).float() + m.dt_bias.float())
    cu = torch.arange(0, t + 1, seq_len, device=x.device)
    state = x.new_zeros(seqs, m.nv, m.dk, m.dv, dtype=torch.float32)
    o, _ = delta_rule(q.reshape(t, m.nk, m.dk), k.reshape(t, m.nk, m.dk), v.reshape(t, m.nv, m.dv), g,
                        torch.sigmoid(m.beta(x).float()), state, cu, [seq_len] * seqs, m.dk ** -0.5, m.eps)
    return m.out(norm_ref.gated_rms_norm(o, m.z(x), m.norm, m.eps, x.dtype))


def batch_of(ids: torch.Tensor, start: int = 0) -> ForwardBatch:
    """[seqs, n] token ids as one stateless flat batch, positions from `start`."""
    seqs, n = ids.shape
    pos = torch.arange(start, start + n, device=ids.device).repeat(seqs)
    return ForwardBatch(ids.reshape(-1).long(), pos, [n] * seqs, [start] * seqs, list(range(seqs)))


def trunk_forward(net: Qwen35Model, ids: torch.Tensor, delta_rule=gdn_ops.chunk_gdn) -> torch.Tensor:
    """Hidden rows after the final norm for [seqs, n] ids: the model's forward, DeltaNet as above."""
    seqs, n = ids.shape
    batch = batch_of(ids)
    x = net.embed_tokens(batch.input_ids)
    cos, sin = net.rotary.cos_sin(batch.positions)
    for layer in net.layers:
        if layer.is_full_attention:
            x, ffn_out = layer(x, None, batch, cos, sin)
            x = x + ffn_out
        else:
            x = x + deltanet_forward(layer.mixer, layer.attn_norm(x), seqs, n, delta_rule)
            x = x + layer.ffn(layer.ffn_norm(x))
    return net.norm(x)


def losses(net: Qwen35Model, ids: torch.Tensor, delta_rule=gdn_ops.chunk_gdn
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP loss, MTP agreement): the head's row t predicts token t + 2 from hidden t and
    token t + 1; agreement is how often its greedy guess equals the trunk's greedy token at t + 1 (what a
    greedy verify accepts)."""
    seqs, n = ids.shape
    hidden = trunk_forward(net, ids, delta_rule)
    logits = net.compute_logits(hidden).view(seqs, n, -1)
    main = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).long())
    rows = hidden.view(seqs, n, -1)[:, :-1].reshape(-1, hidden.shape[-1])
    mtp = net.compute_logits(net.mtp(batch_of(ids[:, 1:]), rows, net)).view(seqs, n - 1, -1)[:, :-1]
    mtp_loss = F.cross_entropy(mtp.reshape(-1, mtp.shape[-1]), ids[:, 2:].reshape(-1).long())
    agree = (mtp.argmax(-1) == logits[:, 1:-1].argmax(-1)).float().mean()
    return main, mtp_loss, agree


# ----------------------------------------------------------------------------------------------- files

def hf_state_dict(net: Qwen35Model) -> dict[str, torch.Tensor]:
    """The network's tensors under Qwen3.5 checkpoint names, in the checkpoint's conventions (norm weights
    as gamma with RMSNorm's 1 + gamma, A_log, conv [C, 1, K]); `hf2q convert` maps them back."""
    out = {"model.embed_tokens.weight": net.embed, "model.norm.weight": net.norm.weight - 1}
    for i, layer in enumerate(net.layers):
        out.update(_layer_tensors(layer, f"model.layers.{i}."))
    head = net.mtp
    out.update({"mtp.fc.weight": head.eh_proj.weight, "mtp.pre_fc_norm_embedding.weight": head.enorm.weight - 1,
                "mtp.pre_fc_norm_hidden.weight": head.hnorm.weight - 1, "mtp.norm.weight": head.shared_head_norm.weight - 1})
    out.update(_layer_tensors(head.layer, "mtp.layers.0."))
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def _layer_tensors(layer: DecoderLayer, p: str) -> dict[str, torch.Tensor]:
    m, f = layer.mixer, layer.ffn
    out = {p + "input_layernorm.weight": layer.attn_norm.weight - 1,
           p + "post_attention_layernorm.weight": layer.ffn_norm.weight - 1,
           p + "mlp.gate_proj.weight": f.gate.weight, p + "mlp.up_proj.weight": f.up.weight,
           p + "mlp.down_proj.weight": f.down.weight}
    if layer.is_full_attention:
        a = p + "self_attn."
        out.update({a + "q_proj.weight": m.q.weight, a + "k_proj.weight": m.k.weight, a + "v_proj.weight": m.v.weight,
                    a + "o_proj.weight": m.o.weight, a + "q_norm.weight": m.q_norm - 1, a + "k_norm.weight": m.k_norm - 1})
    else:
        a = p + "linear_attn."
        out.update({a + "in_proj_qkv.weight": m.qkv.weight, a + "in_proj_z.weight": m.z.weight,
                    a + "in_proj_a.weight": m.alpha.weight, a + "in_proj_b.weight": m.beta.weight,
                    a + "dt_bias": m.dt_bias, a + "A_log": torch.log(-m.a), a + "conv1d.weight": m.conv.unsqueeze(1),
                    a + "norm.weight": m.norm, a + "out_proj.weight": m.out.weight})
    return out


def save_checkpoint(net: Qwen35Model, hf: dict, tokenizer_dir: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(net), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


# ------------------------------------------------------------------------------------------------ main

def train(net: Qwen35Model, data: torch.Tensor, heldout: dict[str, torch.Tensor], size: dict, args, log) -> dict:
    device = torch.device(args.device)
    seq, bsz = size["seq"], size["batch"]
    decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in net.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=size["lr"], betas=(0.9, 0.95), fused=device.type == "cuda")
    rng = random.Random(args.seed)
    amp = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    rule = choose_delta_rule(args.gdn, device)
    if rule == "naive" and importlib.util.find_spec("fla") is None:
        raise SystemExit("--gdn naive runs fla's PyTorch chunked delta rule: install fla-core")
    log(f"delta rule: {rule}")
    t0, step, history = time.perf_counter(), 0, []
    budget = args.minutes * 60 if args.minutes else math.inf
    while step < args.steps and time.perf_counter() - t0 < budget:
        done = max(step / args.steps, (time.perf_counter() - t0) / budget)
        lr = size["lr"] * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = [rng.randrange(0, data.numel() - seq) for _ in range(bsz)]
        ids = torch.stack([data[s:s + seq] for s in starts]).to(device)
        with amp:
            main, mtp, agree = losses(net, ids, DELTA_RULES[rule])
        opt.zero_grad(set_to_none=True)
        (main + MTP_WEIGHT * mtp).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1:  # the budget starts after the first step's kernel compiling and tuning
            t0 = time.perf_counter()
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            row = {"step": step, "s": round(time.perf_counter() - t0, 1), "loss": round(main.item(), 4),
                   "mtp_loss": round(mtp.item(), 4), "mtp_agree": round(agree.item(), 4)}
            history.append(row)
            log(json.dumps(row))
    result = {"gdn": rule, "steps": step, "seconds": round(time.perf_counter() - t0, 1), "history": history}
    for kind, tokens in heldout.items():
        result[f"heldout_{kind}"] = evaluate(net, tokens, seq, amp, device, size["eval_windows"], DELTA_RULES[rule])
        log(json.dumps({f"heldout_{kind}": result[f"heldout_{kind}"]}))
    return result


@torch.no_grad()
def evaluate(net: Qwen35Model, tokens: torch.Tensor, seq: int, amp, device, windows: int,
             delta_rule=gdn_ops.chunk_gdn) -> dict:
    """Losses and MTP agreement on the first `windows` consecutive windows of held-out text."""
    n = min(windows, tokens.numel() // seq)
    ids = tokens[:n * seq].view(n, seq).to(device)
    with amp:
        main, mtp, agree = losses(net, ids, delta_rule)
    return {"loss": round(main.item(), 4), "mtp_loss": round(mtp.item(), 4), "mtp_agree": round(agree.item(), 4)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True, help="HF tokenizer folder of the Qwen3.5 vocabulary "
                   "(tokenizer.json, tokenizer_config.json)")
    p.add_argument("--out", type=Path, required=True, help="writes hf/ (checkpoint), model-OUTTYPE.gguf, "
                   "heldout.json, train.json here")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--minutes", type=float, default=0, help="wall-clock budget for training after its first step "
                   "(0: none); the learning rate decays over whichever of --steps and --minutes ends first")
    p.add_argument("--seq-len", type=int, help="tokens per training window (default: the size's)")
    p.add_argument("--batch-size", type=int, help="windows per step (default: the size's)")
    p.add_argument("--corpus-chars", type=int, help="characters of training text to tokenize (default: the size's; "
                   "0: all)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--outtype", action="append", choices=("f32", "bf16", "q8_0"),
                   help="GGUF type(s) to write (repeatable; default bf16)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts of each kind in heldout.json")
    p.add_argument("--prompt-chars", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gdn", choices=("auto", *DELTA_RULES), default="auto", help="the DeltaNet's delta rule: kernel "
                   "(fla's chunked kernel on CUDA, the reference on CPU), naive (fla's PyTorch chunked form, fp32, "
                   "slower; needs no Triton backward), auto (naive where fla refuses its backward: Hopper with "
                   "Triton >= 3.4.0 and < 3.7.1, fla issue 640; else kernel)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[Qwen35Model, dict]:
    """Data, training, checkpoint and GGUF(s); returns the trained network and the summary."""
    from tokenizers import Tokenizer

    from hf2q.checkpoint.convert import convert

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    size = dict(SIZES[args.size], **{k: v for k, v in (("seq", args.seq_len), ("batch", args.batch_size)) if v})
    if args.corpus_chars is not None:
        size["corpus_chars"] = args.corpus_chars or None
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    docs = stdlib_documents()
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    data = token_stream(tokenizer, docs["train"], size["corpus_chars"])
    chars = size["eval_windows"] * size["seq"] * 8  # enough text for the evaluation windows
    heldout = {kind: token_stream(tokenizer, docs[kind], chars) for kind in ("code", "prose")}
    log(f"{len(docs['train'])} training documents, {data.numel()} tokens; held out: {len(docs['code'])} files, "
        f"{len(docs['prose'])} topics")
    (args.out / "heldout.json").write_text(json.dumps(
        {"code": prompts_from(docs["code"], args.prompts, args.prompt_chars),
         "prose": prompts_from(docs["prose"], args.prompts, args.prompt_chars)}, indent=1))
    hf = hf_config(size)
    net = build_model(model_config(hf), args.seed).to(args.device)
    log(f"{sum(p.numel() for p in net.parameters()) - net.embed.numel()} parameters besides the embedding")
    with fast_path("off"):
        result = train(net, data, heldout, size, args, log)
    hf_dir = save_checkpoint(net, hf, args.tokenizer, args.out / "hf")
    result["gguf"] = [str(convert(hf_dir, args.out / f"model-{t}.gguf", t)) for t in args.outtype or ["bf16"]]
    (args.out / "train.json").write_text(json.dumps({"size": args.size, **result}, indent=1))
    return net, result


def main(argv=None) -> int:
    _, result = run(parse_args(argv))
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
