"""``subquad serve``: load the model, build the engine, serve the OpenAI-compatible API until SIGTERM."""

from __future__ import annotations

import sys

from subquad.cli.common import add_model_flags, check_run_or_model, load_model, nonneg_float, positive


def add_parser(command) -> None:
    v = command("serve", "an OpenAI-compatible HTTP server: continuous batching, prefix-state reuse")
    v.description += ("\n\nfinish_reason: \"stop\" (end of text or a stop string), \"length\" (max_tokens or the\n"
                      "context), \"abort\" (still running when a SIGTERM's --drain-timeout ran out) or \"error\"\n"
                      "(the engine failed on that request; the others and the server go on).")
    add_model_flags(v, [], model_help="a Hugging Face model folder (its tokenizer.json and chat template are used)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (default: none)")
    v.add_argument("--served-model-name", help="the model's name in the API (default: the folder's name)")
    v.add_argument("--max-batch", type=positive, default=16, help="sequences decoded together")
    v.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    v.add_argument("--max-context", type=positive, default=4096, help="prompt plus max_tokens, per request")
    v.add_argument("--prefill-chunk", type=positive, default=512,
                   help="prompt tokens prefilled per loop iteration, between decoding steps")
    v.add_argument("--state-cache-mb", type=nonneg_float, default=256.0,
                   help="bound of the prefix-state cache, exact bytes (0: no cache)")
    v.add_argument("--memory-mb", type=nonneg_float,
                   help="admission budget for live states (KV buffers as allocated, twice while the batch changes) "
                        "plus the prefix cache; 0: no bound (default: half the memory available at start - "
                        "MemAvailable in /proc/meminfo, or the GPU's free memory - and no bound where unknown)")
    v.add_argument("--drain-timeout", type=nonneg_float, default=10.0,
                   help="seconds accepted requests may run on after SIGTERM")
    v.add_argument("--compile-decode", action="store_true",
                   help="decode with the compiled step (subquad.models.decode), compiled before serving")
    v.set_defaults(fn=run)


def run(args) -> int:
    """subquad serve: load the model, build the engine (memory budget: --memory-mb, else half of what is
    available), serve until SIGTERM."""
    from pathlib import Path

    check_run_or_model(args)
    try:
        from subquad.serve import Engine
        from subquad.serve.server import default_memory_mb, end_of_text_ids
        from subquad.serve.server import run as serve_api
    except ImportError as e:
        raise ValueError(f"subquad serve needs the serve extra (pip install 'subquad[serve]'): {e}") from None
    chat_template = None
    if args.model is not None:
        from subquad.serve.chat import load_chat_template

        if not Path(args.model).is_dir():
            raise ValueError(f"--model {args.model} is not a folder")
        chat_template = load_chat_template(args.model)
    model, tok = load_model(args)
    if args.compile_decode:
        _compile_and_warm(model)
    name = args.served_model_name or Path(args.model or args.run).resolve().name
    memory_mb = default_memory_mb(args.device) if args.memory_mb is None else args.memory_mb or None  # 0: none
    engine = Engine(model, tok, max_batch=args.max_batch, max_queue=args.max_queue, max_context=args.max_context,
                    prefill_chunk=args.prefill_chunk, state_cache_mb=args.state_cache_mb, memory_mb=memory_mb,
                    eos_ids=end_of_text_ids(model, tok))
    return serve_api(engine, name, host=args.host, port=args.port, chat_template=chat_template,
                     api_key=args.api_key, drain_timeout=args.drain_timeout)


def _compile_and_warm(model) -> None:
    """The compiled decoding step (``models.decode``), its graphs built before the first request: one batch row,
    then two rows of different lengths (the batch and any KV cache become dynamic sizes), so requests do not
    wait for a compile."""
    from subquad.models.decode import compile_decode

    print("compiling the decoding step (one batch row, then a ragged batch) ...", file=sys.stderr, flush=True)
    compile_decode(model)
    eos = model.config.eos_token_ids
    model.config.eos_token_ids = []
    try:
        model.generate([[0, 0, 0]], 4, temperature=0)
        model.generate([[0, 0], [0, 0, 0]], 4, temperature=0)
    finally:
        model.config.eos_token_ids = eos
