"""Shard a loaded model in place for one tensor-parallel rank.

Every rank loads the whole model with `hf2q.load`, then keeps its share: each block is rebuilt by the
ordinary model classes from the rank's local config, filled with slices of the loaded weights, and its
mixer and FFN get the all-reduce hook of `tp_layers`; the LM head becomes a `VocabParallelHead`. A rule
table names how each parameter is cut; a parameter without a rule fails loudly.

MoE experts are tensor-parallel on the expert FFN dimension (every rank holds a slice of every expert),
not expert-parallel: the work per rank then does not depend on where the router sends tokens (at batch 1
top-8 of 256 experts would leave most ranks idle under expert parallelism), the router and the token
order stay replicated, and one all-reduce per MoE block suffices with no all-to-all. The cost is thinner
GEMMs; expert parallelism is the better choice only once experts outnumber ranks by far *and* batches
are large, which the serving sizes here are not.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from hf2q.distributed.plan import RankPlan, ShardingError, head_rows, plan_rank
from hf2q.distributed.tp_layers import VocabParallelHead, reduce_output
from hf2q.layers.attention import GatedAttention
from hf2q.layers.linear import Linear
from hf2q.layers.mlp import MLP
from hf2q.layers.moe import MoE
from hf2q.model import Model
from hf2q.models.qwen35 import DecoderLayer, Qwen35Model
from hf2q.models.qwen35_mtp import MTPHead

REPLICATE = None  # rule: the whole tensor on every rank


def shard_model(model: Model, rank: int, world: int, group=None) -> Model:
    """This rank's share of `model`; the loaded model is left intact (its tensors are sliced, not moved).

    The returned Model carries the rank's local config (local head counts, full vocabulary), so a
    `HybridCache` built from it holds this rank's K/V heads and DeltaNet state only.
    """
    plan = plan_rank(model.config, rank, world)
    net = shard_net(model.net, plan, group)
    return dataclasses.replace(model, config=net.config, net=net)


def shard_net(full: Qwen35Model, plan: RankPlan, group=None) -> Qwen35Model:
    cfg = plan.local
    with torch.device("meta"):
        net = Qwen35Model(cfg, full.tie_embeddings)
    net.embed, net.rotary, net.norm = full.embed, full.rotary, full.norm
    net.lm_head = VocabParallelHead(shard_vocab(full, plan), cfg.vocab_size, group)
    net.layers = nn.ModuleList(shard_layer(layer, plan, group) for layer in full.layers)
    if full.mtp is not None:  # a new head sharing the replicated parts; the loaded one stays intact
        with torch.device("meta"):
            net.mtp = MTPHead(cfg, nn.Identity())
        for name, child in full.mtp.named_children():
            setattr(net.mtp, name, child)
        net.mtp.embed = full.mtp.embed
        net.mtp.layer = shard_layer(full.mtp.layer, plan, group)
    return net.pack_weights()


def shard_vocab(full: Qwen35Model, plan: RankPlan) -> Linear:
    """This rank's rows of the LM head, padded to an equal count on every rank by repeating the last
    vocabulary row (padding logits are trimmed after the gather). A tied head is a view of the replicated
    embedding whenever no padding is needed; a quantized head is cut by whole rows of blocks."""
    vocab = full.config.vocab_size
    start, end, per = plan.vocab_rows(vocab)
    rows = torch.arange(start, start + per).clamp(max=vocab - 1)
    if full.lm_head is not None:
        return shard_linear(full.lm_head, 0, rows)
    with torch.device("meta"):
        head = Linear(full.config.hidden_size, per)
    embed = full.embed
    weight = embed[start:end] if end - start == per else embed.index_select(0, rows.to(embed.device))
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head


def shard_layer(full: DecoderLayer, plan: RankPlan, group=None) -> DecoderLayer:
    cfg = plan.local
    rotary = full.mixer.rotary if full.is_full_attention else None
    with torch.device("meta"):
        layer = DecoderLayer(cfg, full.mixer.layer_id, rotary)
    layer.attn_norm, layer.ffn_norm = full.attn_norm, full.ffn_norm
    mixer_rules = _attention_rules(full.mixer, plan) if full.is_full_attention else _deltanet_rules(full.mixer, plan)
    fill(layer.mixer, full.mixer, mixer_rules)
    reduce_output(layer.mixer, group)  # row-parallel o / out: a partial sum of the block output
    layer.ffn = shard_ffn(full.ffn, plan, group)
    return layer


def shard_ffn(full: nn.Module, plan: RankPlan, group=None) -> nn.Module:
    """The rank's slice of a dense or MoE FFN, its output summed over `group`: after `down`, or for MoE
    once the routed experts and the shared expert are combined."""
    with torch.device("meta"):
        ffn = _empty_ffn(full, plan)
    fill(ffn, full, _ffn_rules(full, plan))
    reduce_output(ffn, group)
    return ffn


def _empty_ffn(full: nn.Module, plan: RankPlan) -> nn.Module:
    """The rank's FFN module, sized from the loaded weights (an MTP block may differ from the config)."""
    w = plan.world
    if isinstance(full, MoE):
        shared = full.shared.gate.out_features if full.shared is not None else 0
        return MoE(full.router.in_features, full.num_experts, full.top_k, _div(full.expert_dim, w, "expert"),
                   _div(shared, w, "shared-expert"))
    if isinstance(full, MLP):
        return MLP(full.gate.in_features, _div(full.gate.out_features, w, "dense FFN"))
    raise ShardingError(f"no tensor-parallel rule for FFN {type(full).__name__}")


def _div(n: int, world: int, what: str) -> int:
    if n % world:
        raise ShardingError(f"tensor parallel size {world}: the {what} width {n} must be divisible by {world}")
    return n // world


# ---- rules: parameter name -> (dim, indices) or REPLICATE ---------------------------------------------
def _attention_rules(m: GatedAttention, plan: RankPlan) -> dict:
    hd = m.hd
    return {
        "q.weight": (0, head_rows(plan.attn_heads, 2 * hd)),  # per head: [q (hd), gate (hd)]
        "k.weight": (0, head_rows(plan.kv_heads, hd)),
        "v.weight": (0, head_rows(plan.kv_heads, hd)),
        "o.weight": (1, head_rows(plan.attn_heads, hd)),
        "q_norm": REPLICATE, "k_norm": REPLICATE,
    }


def _deltanet_rules(m, plan: RankPlan) -> dict:
    nk, dk, dv = m.nk, m.dk, m.dv
    channels = torch.cat([head_rows(plan.key_heads, dk), head_rows(plan.key_heads, dk, nk * dk),
                          head_rows(plan.value_heads, dv, 2 * nk * dk)])  # [q | k | v] channels
    heads = torch.tensor(plan.value_heads)
    value_rows = head_rows(plan.value_heads, dv)
    return {
        "qkv.weight": (0, channels), "conv": (0, channels),
        "z.weight": (0, value_rows),
        "alpha.weight": (0, heads), "beta.weight": (0, heads), "dt_bias": (0, heads), "a": (0, heads),
        "norm": REPLICATE,
        "out.weight": (1, value_rows),
    }


def _mlp_rules(m: MLP, plan: RankPlan, prefix: str = "") -> dict:
    rows = plan.ffn_rows(m.gate.out_features)
    return {f"{prefix}gate.weight": (0, rows), f"{prefix}up.weight": (0, rows), f"{prefix}down.weight": (1, rows)}


def _ffn_rules(m: nn.Module, plan: RankPlan) -> dict:
    if isinstance(m, MLP):
        return _mlp_rules(m, plan)
    rows = plan.ffn_rows(m.expert_dim, "expert FFN width")
    rules = {"router.weight": REPLICATE, "gate_exps": (1, rows), "up_exps": (1, rows), "down_exps": (2, rows)}
    if m.shared is not None:
        rules.update(_mlp_rules(m.shared, plan, "shared."))
        rules["shared_gate.weight"] = REPLICATE
    return rules


# ---- filling ----------------------------------------------------------------------------------------
def fill(target: nn.Module, source: nn.Module, rules: dict) -> None:
    """Give every parameter of `target` its slice of the same-named parameter of `source` (kept blocks
    of a Linear or an expert stack stay blocks)."""
    for path, mod in list(target.named_modules()):
        if isinstance(mod, Linear):
            name = f"{path}.weight" if path else "weight"
            rule = _rule(rules, name, type(target))
            with _naming(target, name):
                _set(target, path, shard_linear(source.get_submodule(path), *rule))
    if isinstance(source, MoE):
        for name, qtype in source.exps_qtype.items():  # a stack kept as blocks has no dense parameter left
            rule = _rule(rules, name, type(target))
            with _naming(target, name):
                target.set_quantized(name, slice_blocks(source.quant_stack(name)[0], qtype,
                                                        source.stack_shape(name)[-1], *rule), qtype)
    linear_paths = {p for p, mod in target.named_modules() if isinstance(mod, Linear)}
    for name, param in list(target.named_parameters()):
        owner_path, _, attr = name.rpartition(".")
        if owner_path in linear_paths or name.startswith("rotary."):
            continue
        value = _slice(source.get_parameter(name), _rule(rules, name, type(target)))
        if value.shape != param.shape:
            raise ShardingError(f"{type(target).__name__}.{name}: slice {tuple(value.shape)} != {tuple(param.shape)}")
        owner = target.get_submodule(owner_path) if owner_path else target
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))


@contextlib.contextmanager
def _naming(target: nn.Module, name: str):
    """A block that cannot be cut names the tensor."""
    try:
        yield
    except ShardingError as exc:
        raise ShardingError(f"{type(target).__name__}.{name}: {exc}") from None


def _rule(rules: dict, name: str, cls: type):
    if name not in rules:
        raise ShardingError(f"no tensor-parallel rule for {cls.__name__}.{name}")
    rule = rules[name]
    return (None, None) if rule is REPLICATE else rule


def _slice(t: torch.Tensor, rule) -> torch.Tensor:
    dim, idx = rule
    if dim is None:
        return t
    return t.index_select(dim, idx.to(t.device))


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    owner_path, _, attr = path.rpartition(".")
    setattr(root.get_submodule(owner_path) if owner_path else root, attr, module)


def shard_linear(full: Linear, dim: int | None, idx: torch.Tensor | None) -> Linear:
    """A Linear holding rows (dim 0, column-parallel) or input columns (dim 1, row-parallel) of `full`.

    Quantized weights are cut by whole GGUF blocks: a column slice must cover complete blocks.
    """
    if dim is None:
        return full
    n = int(idx.numel())
    out = Linear(full.in_features, n) if dim == 0 else Linear(n, full.out_features)
    if not full.quantized:
        out.weight = nn.Parameter(full.weight.index_select(dim, idx.to(full.weight.device)), requires_grad=False)
        return out
    out.set_quantized(slice_blocks(full.qweight, full.qtype, full.in_features, dim, idx), full.qtype)
    return out


def slice_blocks(raw: torch.Tensor, qtype: str, in_features: int, dim: int | None, idx) -> torch.Tensor:
    """Rows (`dim` before the last) or input columns (the last `dim`, whole blocks only) of kept blocks
    [..., rows, row bytes or interleaved words] holding rows of `in_features` values; `dim` None: all."""
    from hf2q.quant import from_gpu_rows, is_interleaved, to_gpu_rows

    if dim is None:
        return raw
    if dim != raw.dim() - 1:  # rows stay rows in either layout
        return raw.index_select(dim, idx.to(raw.device)).contiguous()
    cols = _block_bytes(idx, qtype).to(raw.device)
    if is_interleaved(raw, qtype):  # interleaved rows: cut ggml's blocks, then regroup
        return to_gpu_rows(from_gpu_rows(raw, qtype, in_features).index_select(-1, cols), qtype)
    return raw.index_select(-1, cols).contiguous()


def _block_bytes(cols: torch.Tensor, qtype: str) -> torch.Tensor:
    """Byte columns of a quantized row that hold exactly the given input columns (whole blocks only)."""
    from hf2q.quant import block_layout

    elems, nbytes = block_layout(qtype)
    if cols.numel() % elems:
        raise ShardingError(f"{qtype}: a slice of {cols.numel()} columns is not whole {elems}-value blocks")
    blocks = cols.view(-1, elems)
    first = blocks[:, 0]
    if bool((first % elems != 0).any()) or not torch.equal(blocks, first[:, None] + torch.arange(elems)):
        raise ShardingError(f"{qtype}: tensor-parallel slices must cut rows at {elems}-value block boundaries")
    return (first // elems * nbytes)[:, None].add(torch.arange(nbytes)).reshape(-1)
