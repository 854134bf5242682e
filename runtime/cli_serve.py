"""`dsgraph serve`: a checkpoint behind an OpenAI-compatible HTTP API (runtime/serve.py).

    dsgraph serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
                  [--backend cuda|reference] [--device cuda] [--dtype bf16] [--bundle DIR] ...
    dsgraph serve --random-weights [--spec SPEC] ...        (token-id prompts only: no tokenizer)

The HTTP packages come with the [serve] extra; without them the command says so in one line.
SIGINT / SIGTERM stop the server: open requests get --shutdown-timeout seconds to finish.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from codegen.paths import DEFAULT_SPEC, SPEC_ARGUMENT, shipped_specs

from .cli_args import whole_number
from .cli_generate import add_engine_args, engine_kwargs, load_tokenizer

# The engine's own default (runtime/engine.py DEFAULT_MAX_NUM_SEQS; a test keeps the two equal):
# named here so `dsgraph serve --help` answers without importing torch.
MAX_NUM_SEQS = 64


def add_serve_args(p: argparse.ArgumentParser) -> None:
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("model", nargs="?", metavar="MODEL_DIR",
                         help="a Hugging Face DeepSeek-V2/V3 checkpoint directory (safetensors + config.json; "
                              "its tokenizer and chat template are used when present)")
    weights.add_argument("--random-weights", action="store_true",
                         help="no checkpoint: serve the spec with random weights (token-id prompts only)")
    p.add_argument("--spec", metavar="SPEC",
                   help=f"the model spec: {SPEC_ARGUMENT} ({', '.join(shipped_specs())}; default: written from "
                        f"MODEL_DIR/config.json; with --random-weights: {DEFAULT_SPEC.stem})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=whole_number(1, 65535), default=8000, help="port to listen on")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in requests and /v1/models (default: MODEL_DIR's folder name, or the "
                        "spec's name)")
    add_engine_args(p)
    p.add_argument("--max-num-seqs", type=whole_number(1), default=MAX_NUM_SEQS, metavar="N",
                   help="requests decoded together at most (more wait for a place)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds open requests get to finish")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                   help="uvicorn's log level")


def _check_port(host: str, port: int) -> None:
    """Refuse a port already taken, in one line, before minutes of loading weights."""
    from .errors import InputError
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another with --port "
                         f"(or --host)") from None


def run_serve(args) -> int:
    """serve a checkpoint over an OpenAI-compatible HTTP API (completions, chat, streaming)"""
    from .errors import InputError, MissingDependencyError, require_runtime
    require_runtime("serve")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise MissingDependencyError(f"dsgraph serve needs {e.name}, which is not installed: "
                                     f"pip install 'dsgraph[serve]'") from None
    if args.model is None and not args.random_weights:
        raise InputError("give MODEL_DIR (a checkpoint folder) or --random-weights (with --spec, or the default spec)")
    if args.shutdown_timeout < 0:
        raise InputError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    kwargs = engine_kwargs(args)
    _check_port(args.host, args.port)

    from .engine import Engine
    from .serve import Server
    kwargs["max_num_seqs"] = args.max_num_seqs
    if args.random_weights:
        engine = Engine.from_spec(None if args.bundle else args.spec or str(DEFAULT_SPEC), **kwargs)
    else:
        engine = Engine.from_pretrained(args.model, spec=args.spec, progress=True, **kwargs)
    tokenizer = load_tokenizer(args.model, needed=False, warn=args.model is not None,
                               without="serving token-id prompts only (no text, no chat)")
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                      else engine.spec.name)
    server = Server(engine, tokenizer, name)
    print(f"dsgraph: serving {name} ({kwargs['backend']} on {engine.device}, max_seq_len {engine.max_seq_len}, "
          f"{engine.tables.allocator.num_blocks} cache blocks) at http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app(), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    _graceful_server_class()(config).run()
    print("dsgraph: server stopped", file=sys.stderr)
    return 0


def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, but a SIGINT / SIGTERM that it answered with a graceful shutdown is not
        raised again afterwards: the stop it asked for is done, so the process exits 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()
    return GracefulServer
