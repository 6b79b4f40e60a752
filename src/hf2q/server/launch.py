"""`hf2q serve`: flags, model loading, engine start, and listening only once the model is ready.

The port is taken (bound, not yet listening) before anything loads: a port in use fails in a second, not
after minutes of loading, and nothing started meanwhile (a tensor-parallel group's sockets) can take
it. Until the model is ready, connections to it are refused.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import socket
import time
from pathlib import Path

from hf2q import envs
from hf2q.config import STATE_DTYPES, SchedulerConfig
from hf2q.devices import add_device_args, dtype_name, keep_quantized, resolve_device, resolve_dtype
from hf2q.engine.step_profiler import StepProfiler
from hf2q.server.sizing import CPU_MAX_MODEL_LEN, CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_SEQS, choose

from hf2q.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from hf2q.server.media import add_media_args, media_policy
from hf2q.server.first_use import grammar_in_background
from hf2q.server.settle import settle
from hf2q.spec.proposer import add_spec_args, spec_config

log = logging.getLogger("hf2q.serve")



def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig()
    p.add_argument("--model", help="GGUF file to serve, or a Hugging Face model as OWNER/REPO[:QUANT] or "
                   "hf://OWNER/REPO[:QUANT] (downloaded to the HF cache; QUANT default Q4_K_M, else the only GGUF); "
                   "without it a tiny built-in demo model is served")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=port_number, default=8080, help="TCP port, 1-65535 (default: %(default)s)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health (default: none, no key)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (for a Prometheus scraper that sends none)")
    p.add_argument("--profile-dir", metavar="DIR",
                   help="serve POST /start_profile and /stop_profile: torch's profiler over the engine's steps between "
                        "the two, written to DIR as a Chrome trace and a table of the top ops (default: not served)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; larger ones get 413 before parsing (default: %(default)s)")
    p.add_argument("--allowed-origins", type=origins, default=(),
                   help="CORS: comma-separated origins browsers may call from, or '*' for any (default: none)")
    add_media_args(p)
    p.add_argument("--served-model-name", help="model id in the API (default: the GGUF's general.name or stem)")
    p.add_argument("--chat-template", help="Jinja chat template file overriding the GGUF's own (default: the GGUF's)")
    vision = p.add_mutually_exclusive_group()
    vision.add_argument("--mmproj", metavar="P.gguf",
                        help="llama.cpp's vision projector file; images are then accepted (default: the one "
                             "mmproj*.gguf beside the model, if any)")
    vision.add_argument("--no-mmproj", action="store_true",
                        help="serve text only, even with an mmproj*.gguf beside the model")
    p.add_argument("--max-model-len", type=int,
                   help="longest prompt + completion in tokens (default: on CUDA the model's context when one such "
                        f"sequence fits in the K/V pool, else what fits; on the CPU min(model context, "
                        f"{CPU_MAX_MODEL_LEN}))")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences decoded together (default: {CUDA_MAX_NUM_SEQS} on CUDA, {CPU_MAX_NUM_SEQS} on the CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens one engine step may compute over all sequences (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help="prompt tokens of one sequence prefilled per step (default: %(default)s)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="queued requests before 429 (default: %(default)s)")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="float32",
                   help="DeltaNet recurrent state storage in the slots and prefix checkpoints: bfloat16 halves the "
                        "bytes a decode step reads and writes (the update stays fp32, rounded once as it is "
                        "stored; vLLM's default for these models); default: %(default)s")
    p.add_argument("--short-prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on CUDA, replay steps of up to 127 new tokens over up to 64 requests (a follow-up turn "
                        "after a prefix-cache hit, a new prompt beside decoding streams) in CUDA graphs, as decode "
                        "steps are; a chat turn's anchor then cuts its chunk where the rest fits a graph "
                        "(default: on for CUDA without --tensor-parallel-size, off elsewhere)")
    p.add_argument("--batched-weights", choices=("auto", "quantized", "dense", "columns"), default="auto",
                   help="what steps of 16 or more rows multiply for a quantized file's projections: its blocks "
                        "(the tile kernels), or `dense`: a copy dequantized once after load and kept beside the "
                        "blocks (cuBLAS; two bytes a weight more of GPU memory, so a smaller K/V pool); fewer rows "
                        "always read the blocks. auto: dense on one CUDA device where the copies take at most a "
                        "quarter of the memory free after loading, else quantized. columns (CUDA): as auto, and "
                        "the Q4_K projections laid out once more by column for steps of 5-16 rows (about 0.58 "
                        "bytes a weight) (default: %(default)s)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="queue each decode step before reading the previous step's tokens, so the host's work "
                        "(stop checks, detokenizing, streaming) overlaps the GPU's; for rows without penalties, "
                        "logprobs, grammars, or top-p/min-p without a top-k <= 256 (others step as usual); same "
                        "tokens; with n-gram speculation, while the batch is too large for drafts (default: on "
                        "for CUDA without MTP speculation or --tensor-parallel-size; asking for it with either "
                        "is refused)")
    p.add_argument("--sampling-defaults", choices=("model", "openai"), default="model",
                   help="what a request that leaves out temperature, top_p, top_k, min_p or repetition_penalty "
                        "gets: model, the model file's recommended values (general.sampling.*, from its "
                        "generation_config.json), where it has them, else OpenAI's; openai, always OpenAI's "
                        "(temperature 1, no truncation, no penalty). Default: %(default)s")
    p.add_argument("--default-chat-template-kwargs", type=json.loads, default={},
                   help="JSON object merged under each request's chat_template_kwargs, "
                        "e.g. '{\"enable_thinking\": false}' (default: none)")
    # Testing aid, hidden from --help: a JSON file holding a list of strings; generation i emits reply i mod len
    # (tokenized, forced instead of sampled), so reasoning and tool-call parsing are tested through the server.
    p.add_argument("--scripted-replies", help=argparse.SUPPRESS)
    p.add_argument("--prefix-cache-gb", type=float,
                   help="retained-prefix budget: K/V and DeltaNet state kept for later prompts to resume from "
                        "(default: 10%% of free GPU memory on CUDA, 1 GB on CPU)")
    p.add_argument("--prefix-checkpoint-stride", type=int, default=1024,
                   help="also keep a prefix checkpoint every N prompt tokens of a prefill, so long shared "
                        "documents resume too (0: only turn anchors and finished requests; default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn retained-prefix reuse off")
    p.add_argument("--no-prefix-rerender", action="store_true",
                   help="after a chat answer, do not prefill the history in the background as the next user "
                        "turn will render it (which lets the turn after an agent loop resume from the cache)")
    p.add_argument("--prefix-cache-dir", metavar="DIR",
                   help="also write prefix checkpoints to files in DIR (created 0700) and resume from them "
                        "after a restart of the same model (default: none, in memory only)")
    p.add_argument("--prefix-cache-disk-gb", type=float, default=10.0,
                   help="bytes the checkpoint files in --prefix-cache-dir may hold, least recently used "
                        "deleted beyond it (default: %(default)s)")
    add_device_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N local ranks (one GPU each on CUDA); this process is rank 0 and "
                        "spawns the others (default: %(default)s)")
    add_spec_args(p)
    p.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, stop taking requests and give running ones S seconds to finish "
                        "before ending them with an error event (default: %(default)s, end them at once)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log verbosity (default: %(default)s)")


def _model_name(args, model, is_demo: bool) -> str:
    if args.served_model_name:
        return args.served_model_name
    if is_demo:
        return "hf2q-demo"
    return model.config.name or model.path.stem


def _sampling_defaults(args, model) -> dict:
    """The model file's recommended sampling unless --sampling-defaults openai (logged either way when the
    file has any, since it changes what a request without those fields gets)."""
    from hf2q.server.sampling import recommended_sampling

    recommended = recommended_sampling(model.metadata)
    if not recommended:
        return {}
    shown = ", ".join(f"{k} {v}" for k, v in recommended.items())
    if getattr(args, "sampling_defaults", "model") == "openai":
        log.info("not using the model file's recommended sampling (%s): --sampling-defaults openai", shown)
        return {}
    log.info("requests that leave them out get the model file's recommended sampling: %s "
             "(--sampling-defaults openai for OpenAI's defaults)", shown)
    return recommended


def _mmproj_path(args, model_path: Path, is_demo: bool) -> Path | None:
    """--mmproj, else the one mmproj*.gguf beside the model (logged, so the choice is visible); None for text only."""
    from hf2q.checkpoint.mmproj import find_mmproj

    if getattr(args, "no_mmproj", False) or is_demo:
        return None
    if getattr(args, "mmproj", None):
        return Path(args.mmproj)
    found = find_mmproj(model_path)
    if found is not None:
        log.info("vision projector: %s (found beside the model; --no-mmproj serves text only)", found)
    return found


def _scripted(path: str | None, tokenizer) -> list[list[int]] | None:
    if not path:
        return None
    replies = json.loads(Path(path).read_text())
    if not isinstance(replies, list) or not replies or not all(isinstance(r, str) for r in replies):
        raise ValueError(f"--scripted-replies {path}: expected a non-empty JSON list of strings")
    return [tokenizer.encode(r) for r in replies]


def _limits(args, model, device, dtype, prefix_bytes: int = 0):
    """The serving limits (server/sizing.py), from the GPU's free memory after loading on CUDA, less what
    the prefix cache is given."""
    import torch

    from hf2q.cache.kv_pool import kv_cache_format

    free = total = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free -= prefix_bytes
    max_len = min(args.max_model_len, model.config.context_length) if args.max_model_len else None
    kv_format = kv_cache_format(getattr(args, "kv_cache_dtype", "auto"), dtype_name(dtype))
    return choose(model.config, device.type, kv_format, args.max_num_seqs, max_len, free, total,
                  held_states=verify_graph_states(args, device), state_dtype=getattr(args, "state_dtype", "float32"))


def verify_graph_states(args, device) -> int:
    """DeltaNet states the verify graphs hold besides the slots (hf2q.spec.states.KeptPositions): with
    --speculative on CUDA, PREFIXES per request of up to --spec-max-batch."""
    from hf2q.spec.states import PREFIXES

    if getattr(args, "speculative", "off") == "off" or device.type != "cuda":
        return 0
    return PREFIXES * args.spec_max_batch


def resolve_async_scheduling(asked: bool | None, device, tp: int) -> bool:
    """--async-scheduling as asked (None: not said), else on for CUDA (measured on the H200: 3.4x the output
    rate at 16 streams, 1.5x at 64; BENCHMARKS.md). The other tensor-parallel ranks need each step's ids on
    the host: asking for both is refused, the default leaves it off. With speculation, steps queue ahead while
    the batch is too large for drafts (--spec-max-batch), the MTP head catching up on each one's rows."""
    if asked and tp != 1:
        raise ValueError("--async-scheduling does not work with --tensor-parallel-size yet")
    if asked is None:
        return device.type == "cuda" and tp == 1
    return asked


def resolve_short_prefill_graphs(asked: bool | None, device, tp: int) -> bool:
    """--short-prefill-graphs as asked (None: not said), else on for CUDA with one rank (measured on an H100 against
    eager prefill steps: a lone 64-token prompt's first token 41 against 145 ms, a follow-up turn after an
    8,000-token hit 42 ms, 64 streams +2.5%; BENCHMARKS.md). The graphs replay on rank 0's runner: asking for them
    on another device or with tensor parallelism is refused by name rather than accepted and ignored."""
    if asked and device.type != "cuda":
        raise ValueError(f"--short-prefill-graphs needs a CUDA device (this server runs on {device.type})")
    if asked and tp != 1:
        raise ValueError("--short-prefill-graphs does not work with --tensor-parallel-size yet")
    if asked is None:
        return device.type == "cuda" and tp == 1
    return asked


def build_state(args):
    """Load the model and start the engine: everything `build_app` needs."""
    import hf2q
    from hf2q.engine.async_engine import AsyncEngine
    from hf2q.engine.engine import Engine
    from hf2q.server.state import ServerConfig, ServerState
    from hf2q.vision.preprocess import image_processing

    device = resolve_device(args.device)
    # fla's delta-rule kernels (seconds of import) on a thread from here, beside the rest of the start and the load;
    # not before the imports above, which a thread importing beside them could meet half done or in a lock cycle
    if device.type == "cuda":
        from hf2q.kernels.gdn.chunked_fla import import_in_background
        import_in_background()

    if not isinstance(args.default_chat_template_kwargs, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    media = media_policy(args)  # a bad --allowed-local-media-path fails before minutes of loading
    is_demo = args.model is None
    if is_demo:
        from hf2q.demo import demo_model_path

        log.info("no --model given: serving the built-in DEMO model (tiny random weights, gibberish output)")
        path = demo_model_path()
    else:
        from hf2q.checkpoint.hub import local_model_path

        # the repository's projector only where the one beside the model would be used
        beside = not (getattr(args, "no_mmproj", False) or getattr(args, "mmproj", None))
        path = local_model_path(args.model, projector=beside)
    dtype = resolve_dtype(args.dtype, device)
    tp = getattr(args, "tensor_parallel_size", 1)
    spec = spec_config(args)
    if tp != 1 and spec.enabled:  # the other ranks replay plain steps only
        raise ValueError("--speculative does not work with --tensor-parallel-size yet")
    args.async_scheduling = resolve_async_scheduling(getattr(args, "async_scheduling", None), device, tp)
    args.short_prefill_graphs = resolve_short_prefill_graphs(getattr(args, "short_prefill_graphs", None), device, tp)
    if tp != 1 and getattr(args, "batched_weights", "auto") in ("dense", "columns"):  # ranks load their own shards
        raise ValueError(f"--batched-weights {args.batched_weights} does not work with --tensor-parallel-size yet")
    if getattr(args, "batched_weights", "auto") == "columns" and device.type != "cuda":
        raise ValueError("--batched-weights columns needs a CUDA device (the column layout is read by a GPU kernel)")
    mmproj = _mmproj_path(args, path, is_demo)
    if tp != 1 and mmproj is not None:  # the vision tower runs on rank 0's side only
        raise ValueError("a vision projector (--mmproj, or one beside the model) does not work with "
                         "--tensor-parallel-size yet; pass --no-mmproj")
    envs.keep_autotuning()  # before any rank is spawned: every process keeps its autotuning results
    workers = None
    if tp != 1:
        from hf2q.distributed.serve import TPLaunch, TPWorkers, check_tensor_parallel

        check_tensor_parallel(path, tp, device)
        workers = TPWorkers(TPLaunch(tp, str(path), device.type, dtype, keep_quantized(args)))
    log.info("loading %s on %s (%s) ...", path, device, dtype_name(dtype))
    t0 = time.monotonic()
    model = hf2q.load(path, device=device, dtype=dtype, chat_template=args.chat_template,
                      keep_quantized=keep_quantized(args), mmproj=mmproj)
    log.info("loaded %s (%s, %d layers) in %.1f s", path.name, model.config.arch, model.config.num_layers,
             time.monotonic() - t0)
    if args.max_model_len and args.max_model_len > model.config.context_length:
        log.warning("--max-model-len %d exceeds the model's context %d; using %d", args.max_model_len,
                    model.config.context_length, model.config.context_length)
    ahead = grammar_in_background(model, device)
    if tp == 1 and getattr(args, "batched_weights", "auto") != "quantized":
        from hf2q.server.dense_copies import keep_column_weights, keep_dense_weights
        if args.batched_weights == "columns":
            keep_column_weights(model.net)
        keep_dense_weights(model.net, device, dtype, asked=args.batched_weights == "dense")
    engine_config = sized_engine_config(args, model, device, dtype, spec)
    max_len, cache = engine_config.max_model_len, engine_config.cache
    if workers is not None:  # this process is rank 0
        aengine = workers.start_engine(model, engine_config)
        engine = aengine.engine
        log.info("warming up: throwaway requests through the %d ranks (no decode graphs) ...", tp)
    else:
        engine, aengine = Engine(model, engine_config), None
        log.info("warming up: compiling, tuning and capturing decode graphs for up to %d sequences ...",
                 args.max_num_seqs)
    t0 = time.monotonic()
    from hf2q.kernels.tuning.timing import SPENT, Spent
    engine.warm_up()
    log.info("warmed up in %.1f s (%s; timed choices kept in %s)", time.monotonic() - t0, SPENT.since(Spent()),
             envs.tune_cache() or "memory only")
    settle(device, ahead)
    if aengine is None:
        aengine = AsyncEngine(engine)
    config = ServerConfig(model_name=_model_name(args, model, is_demo), is_demo=is_demo, api_key=args.api_key,
                          default_chat_template_kwargs=dict(args.default_chat_template_kwargs),
                          max_model_len=max_len, allowed_origins=tuple(getattr(args, "allowed_origins", ())),
                          metrics_public=getattr(args, "metrics_public", False),
                          max_request_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
                          prefix_cache=cache.prefix_cache_bytes > 0, media=media,
                          prefix_rerender=cache.prefix_cache_bytes > 0
                          and not getattr(args, "no_prefix_rerender", False),
                          sampling_defaults=_sampling_defaults(args, model))
    vision = image_processing(model.vision.cfg) if model.vision is not None else None
    state = ServerState(model, aengine, config, scripted_replies=_scripted(args.scripted_replies, model.tokenizer),
                        vision=vision)
    aengine.on_step = lambda eng, _outputs: state.metrics.observe_step(eng)
    if getattr(args, "profile_dir", None):
        aengine.profiler = StepProfiler(args.profile_dir, device)
        log.info("profiling on request: POST /start_profile, then /stop_profile, writes to %s", args.profile_dir)
    aengine.start()
    return state


def sized_engine_config(args, model, device, dtype, spec):
    """The engine's configuration from the flags and the device: serving limits sized from free memory (logged;
    the chosen max_num_seqs is written back into args for later log lines) and the prefix cache's share."""
    from hf2q.engine.engine import EngineConfig

    tp = getattr(args, "tensor_parallel_size", 1)
    prefix_bytes = prefix_budget(args, device)
    limits = _limits(args, model, device, dtype, prefix_bytes)
    log.info("sized: %s", limits.why)
    args.max_num_seqs = limits.max_num_seqs
    cache = with_prefix_cache(limits.cache, args, prefix_bytes)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            prefill_chunk=args.prefill_chunk, max_waiting=args.max_waiting)
    return EngineConfig(max_model_len=limits.max_model_len, scheduler=sched, cache=cache, spec=spec,
                        async_scheduling=resolve_async_scheduling(getattr(args, "async_scheduling", None), device, tp),
                        short_prefill_graphs=resolve_short_prefill_graphs(getattr(args, "short_prefill_graphs", None),
                                                                          device, tp))


def prefix_budget(args, device) -> int:
    """Bytes for retained prefixes: --prefix-cache-gb, else 10% of the GPU's free memory (1 GiB on the CPU);
    0 with --no-prefix-cache."""
    if getattr(args, "no_prefix_cache", False):
        return 0
    if getattr(args, "prefix_checkpoint_stride", 1024) < 0:
        raise ValueError("--prefix-checkpoint-stride must be >= 0")
    gb = getattr(args, "prefix_cache_gb", None)
    if gb is not None:
        return max(int(gb * (1 << 30)), 0)
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0] * 0.10)
    return 1 << 30


def with_prefix_cache(cache, args, nbytes: int):
    """The sized cache with the prefix cache's settings. Checkpoints keep their K/V in pool blocks no request
    holds (admission evicts checkpoints when a request needs the blocks) and their DeltaNet states in
    memory allocated as they are taken, which the budget bounds and the sizing left out of the pool."""
    import dataclasses

    stride = getattr(args, "prefix_checkpoint_stride", 1024)
    if nbytes <= 0:
        return dataclasses.replace(cache, prefix_cache_bytes=0, prefix_checkpoint_stride=stride)
    disk_dir = getattr(args, "prefix_cache_dir", None)
    disk_bytes = max(int(getattr(args, "prefix_cache_disk_gb", 10.0) * (1 << 30)), 0)
    log.info("prefix cache: %.2f GiB budget (K/V in free pool blocks, DeltaNet states outside the pool)",
             nbytes / (1 << 30))
    return dataclasses.replace(cache, prefix_cache_bytes=nbytes, prefix_checkpoint_stride=stride,
                               prefix_cache_dir=disk_dir, prefix_cache_disk_bytes=disk_bytes)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hf2q.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = reserve_port(args.host, args.port)
    try:
        state = build_state(args)
    except BaseException:
        sock.close()
        raise
    app = build_app(state)
    if state.scripted_replies:
        log.warning("--scripted-replies is on: replies are scripted, not sampled (testing aid)")
    demo = " (DEMO model)" if state.config.is_demo else ""
    log.info("serving %r%s at http://%s:%d/v1 (max_model_len %d, max_num_seqs %d, async scheduling %s)",
             state.config.model_name, demo, args.host, args.port, state.config.max_model_len, args.max_num_seqs,
             "on" if args.async_scheduling else "off")
    grace = getattr(args, "shutdown_timeout", 0.0)
    if grace < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    # uvicorn's own timeout leaves room for the ended streams to send their error event and [DONE]
    server = _server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=grace + 5), state, grace)
    server.run(sockets=[sock])
    # A stop the engine asked for because it cannot go on (a dead tensor-parallel rank) is a failure.
    return 1 if state.engine.failure else 0


def _server(config, state, grace: float = 0.0):
    """uvicorn's server, which on SIGTERM (or Ctrl-C) stops listening, lets running generations go on for
    `grace` seconds, then ends the rest.

    Those streams close with an error event and [DONE] instead of being cut when uvicorn's graceful timeout
    runs out, and a SIGTERM stop exits 0, as a requested stop should, not by uvicorn's re-raised signal.
    """
    import asyncio

    import uvicorn

    def end_running() -> None:
        state.engine.stop_requests("the server is shutting down")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            if grace > 0:
                log.info("shutting down: running requests have %.0f s to finish", grace)
                timer = asyncio.get_running_loop().call_later(grace, end_running)
            else:
                end_running()
            try:
                await super().shutdown(sockets)
            finally:
                if grace > 0:
                    timer.cancel()

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    return Server(config)


def port_number(text: str) -> int:
    """argparse type: a TCP port one can listen on (getaddrinfo would wrap 99999 to another port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: use 1-65535")
    return port


def origins(text: str) -> tuple[str, ...]:
    """argparse type: 'https://a.example,http://localhost:3000' or '*'."""
    return tuple(o.strip() for o in text.split(",") if o.strip())


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not listening yet. OSError with a plain message when it is taken."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse TIME_WAIT ports
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is in use (choose another with --port)") from None
        raise OSError(f"cannot bind {host}:{port}: {err.strerror}") from None
    return sock
