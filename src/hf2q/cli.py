"""The `hf2q` command: info, generate, serve, convert, bench."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from hf2q.devices import add_device_args, dtype_name, keep_quantized, resolve_device, resolve_dtype
from hf2q.spec.proposer import add_spec_args, spec_config

USER_ERRORS = (FileNotFoundError, ValueError, OSError)


def _add_info(p) -> None:
    p.add_argument("model", help="GGUF file, or a Hugging Face model OWNER/REPO[:QUANT] (fetched into the HF cache)")
    p.set_defaults(func=run_info)


def run_info(args) -> int:
    from hf2q.checkpoint.gguf_file import GGUFFile
    from hf2q.checkpoint.hub import local_model_path
    from hf2q.config import ModelConfig
    from hf2q.text.tokenizer import Tokenizer

    gguf = GGUFFile(local_model_path(args.model))
    gguf.check_types()
    cfg = ModelConfig.from_gguf_metadata(gguf.metadata)
    types = Counter(gguf.info(n).type_name for n in gguf.tensor_names)
    params = 0
    for n in gguf.tensor_names:
        count = 1
        for d in gguf.info(n).shape:
            count *= d
        params += count
    tok = Tokenizer.from_gguf_metadata(gguf.metadata)
    kinds = "".join("A" if cfg.is_full_attention(i) else "L" for i in range(cfg.num_layers))
    lines = [
        f"file:            {gguf.path}",
        f"architecture:    {cfg.arch}" + (f" ({cfg.name})" if cfg.name else ""),
        f"parameters:      {params:,}",
        f"tensor types:    " + ", ".join(f"{k}×{v}" for k, v in sorted(types.items())),
        f"layers:          {cfg.num_layers} ({len(cfg.full_attention_layers)} full attention, "
        f"{len(cfg.linear_layers)} Gated DeltaNet) + {cfg.num_mtp_layers} MTP",
        f"layer kinds:     {kinds}  (A = full attention, L = linear)",
        f"hidden:          {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} × {cfg.head_dim}",
        f"ffn:             " + (f"MoE {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, "
                                f"expert {cfg.moe_intermediate_size}, shared {cfg.shared_expert_intermediate_size}"
                                if cfg.is_moe else f"dense {cfg.intermediate_size}"),
        f"context:         {cfg.context_length}",
        f"vocab:           {cfg.vocab_size}",
        f"eos ids:         {sorted(tok.eos_token_ids)}",
        f"chat template:   " + ("from the GGUF (tokenizer.chat_template)" if "tokenizer.chat_template" in
                                gguf.metadata else "none in the file"),
    ]
    print("\n".join(lines))
    return 0


def _add_generate(p) -> None:
    p.add_argument("--model", required=True, help="GGUF file, or a Hugging Face model OWNER/REPO[:QUANT]")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-tokens", help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--json", action="store_true", help="print prompt tokens, tokens and text as JSON")
    add_device_args(p)
    add_spec_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    import hf2q
    from hf2q.engine.engine import Engine, EngineConfig
    from hf2q.engine.sampling_params import SamplingParams
    from hf2q.engine.scheduler import SchedulerConfig
    from hf2q.cache.kv_pool import kv_cache_format
    from hf2q.checkpoint.hub import local_model_path
    from hf2q.config import CacheConfig

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = hf2q.load(local_model_path(args.model), device=device, dtype=dtype, keep_quantized=keep_quantized(args))
    if args.prompt_tokens is not None:
        try:
            prompt = [int(t) for t in args.prompt_tokens.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-tokens must be comma-separated integers, got {args.prompt_tokens!r}")
    else:
        prompt = model.tokenizer.encode(args.prompt)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    max_len = min(model.config.context_length, len(prompt) + args.max_tokens)
    blocks = -(-max_len // 16)
    engine = Engine(model, EngineConfig(max_model_len=model.config.context_length,
                                        scheduler=SchedulerConfig(max_num_seqs=1, prefill_chunk=args.prefill_chunk,
                                                                  max_num_batched_tokens=args.prefill_chunk),
                                        # a second slot and block hold the decode graphs' padding rows (CUDA)
                                        cache=CacheConfig(num_slots=2, num_blocks=blocks + 1, block_size=16,
                                                          kv_dtype=kv_cache_format(args.kv_cache_dtype,
                                                                                   dtype_name(dtype))),
                                        spec=spec_config(args)))
    tokens: list[int] = []
    text = []
    for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
        text.append(out.new_text)
        if not args.json:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"prompt_tokens": prompt, "tokens": tokens, "text": "".join(text)}, ensure_ascii=False))
    else:
        print()
    return 0


def _add_serve(p) -> None:
    from hf2q.server.launch import add_serve_args, run_serve

    add_serve_args(p)
    p.set_defaults(func=run_serve)


def _add_convert(p) -> None:
    from hf2q.checkpoint.convert_cli import add_convert_args, run_convert

    add_convert_args(p)
    p.set_defaults(func=run_convert)


def _add_bench(p) -> None:
    from hf2q.bench import add_bench_args, run_bench

    p.epilog = "`hf2q bench serve --help`: measure a server under concurrent streaming load"
    add_bench_args(p)
    p.set_defaults(func=run_bench)


# name -> (help, what adds its flags); the last three import optional parts of the install
COMMANDS = {
    "info": ("describe a GGUF model file", _add_info),
    "generate": ("generate text from a prompt", _add_generate),
    "serve": ("serve a model over an OpenAI-compatible HTTP API", _add_serve),
    "convert": ("convert a Hugging Face Qwen3.5 checkpoint to GGUF", _add_convert),
    "bench": ("benchmark real-shape random-weight models on a GPU", _add_bench),
}


# pip's name for a module whose package is named otherwise
_PIP_NAMES = {"fla": "fla-core", "prometheus_client": "prometheus-client"}


def _missing_module(exc: ImportError) -> str | None:
    """The third-party module an ImportError names (None: none, or hf2q's own, which is a bug to show)."""
    module = (exc.name or "").split(".")[0]
    return module if module and module != "hf2q" else None


def _missing_message(command: str, exc: ImportError) -> str:
    """Which module `hf2q <command>` could not import, and how to install it."""
    module = _missing_module(exc)
    if module is None:
        return f"error: hf2q {command} is unavailable in this install: {exc}"
    return (f"error: hf2q {command} needs the Python module '{module}', which could not be imported ({exc}); "
            f"install it with: pip install {_PIP_NAMES.get(module, module)}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the flags of every command, or of command `only` alone: adding a command's flags imports
    its modules (serve's the server and torch), which `hf2q --help` or another command need not wait for."""
    parser = argparse.ArgumentParser(prog="hf2q", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if only is not None and name != only:
            continue
        try:
            add(p)
        except ImportError as exc:  # an optional part missing from this install: say so when it is asked for
            p.set_defaults(missing=exc)
    return parser


def _bench_serve_parser() -> argparse.ArgumentParser:
    from hf2q.loadgen import __doc__ as doc, add_loadgen_args, run_loadgen

    parser = argparse.ArgumentParser(prog="hf2q bench serve", description=doc.split("\n\n")[0])
    add_loadgen_args(parser)
    parser.set_defaults(func=run_loadgen)
    return parser


def _bench_vision_parser() -> argparse.ArgumentParser:
    from hf2q.bench.vision import __doc__ as doc, add_bench_vision_args, run_bench_vision

    parser = argparse.ArgumentParser(prog="hf2q bench vision", description=doc.split("\n\n")[0])
    add_bench_vision_args(parser)
    parser.set_defaults(func=run_bench_vision, command="bench")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `hf2q bench [flags]` is the GPU model bench; `hf2q bench serve [flags]` the load generator. Told apart
    # here because the model bench takes no subcommand and must keep parsing its flags as before.
    if argv[:2] == ["bench", "serve"]:
        args = _bench_serve_parser().parse_args(argv[2:])
    elif argv[:2] == ["bench", "vision"]:
        args = _bench_vision_parser().parse_args(argv[2:])
    else:
        # the command is the first word that is not a flag (the top level takes only -h)
        parser = build_parser(only=next((a for a in argv if not a.startswith("-")), ""))
        args, unknown = parser.parse_known_args(argv)
        if getattr(args, "missing", None) is not None:  # its flags are unknown only because its module is missing
            print(_missing_message(args.command, args.missing), file=sys.stderr)
            return 1
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:  # a module the command imports when it runs (uvicorn for serve) is missing
        if _missing_module(exc) is None:
            raise
        print(_missing_message(args.command, exc), file=sys.stderr)
        return 1
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
