"""``subquad serve``: load the model, build the engine, serve the OpenAI-compatible API until SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from subquad.cli.common import add_model_flags, check_run_or_model, load_model, nonneg_float, positive
from subquad.cli.generate import DRAFT_TOKENS, check_speculative_flag, load_draft

KEY_ENV = "SUBQUAD_API_KEY"


def add_parser(command) -> None:
    v = command("serve", "an OpenAI-compatible HTTP server: continuous batching, prefix-state reuse")
    v.description += ("\n\nfinish_reason: \"stop\" (end of text or a stop string), \"length\" (max_tokens or the\n"
                      "context), \"abort\" (still running when a SIGTERM's --drain-timeout ran out) or \"error\"\n"
                      "(the engine failed on that request; the others and the server go on).")
    add_model_flags(v, [], model_help="a Hugging Face model folder (its tokenizer.json and chat template are used), "
                    "or a GGUF file (.gguf, read as `subquad generate --model x.gguf` reads it: its tokenizer, "
                    "chat template - tokenizer.chat_template - and end-of-text ids from its metadata)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
                                     "(default: none; it shows in the process list: prefer --api-key-file or "
                                     f"{KEY_ENV})")
    v.add_argument("--api-key-file", metavar="PATH", help="the API key in a file (surrounding whitespace dropped)")
    v.add_argument("--served-model-name", help="the model's name in the API (default: the folder's name)")
    v.add_argument("--max-batch", type=positive, default=16, help="sequences decoded together")
    v.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    v.add_argument("--max-context", type=positive, default=4096, help="prompt plus max_tokens, per request")
    v.add_argument("--prefill-chunk", type=positive, default=512,
                   help="prompt tokens prefilled per loop iteration, between decoding steps")
    v.add_argument("--state-cache-mb", type=nonneg_float, default=256.0,
                   help="bound of the prefix-state cache, exact bytes (0: no cache)")
    v.add_argument("--prefix-block", type=positive,
                   help="prompt tokens between two prefix-state checkpoints kept during prefill (also kept at each "
                        "chat message's end); a prompt sharing N tokens with a cached one resumes at least "
                        "N - N %% block in (default: serve.engine.PREFIX_BLOCK, 256)")
    v.add_argument("--memory-mb", type=nonneg_float,
                   help="admission budget for live states (KV buffers as allocated, twice while the batch changes) "
                        "plus the prefix cache; 0: no bound (default: half the memory available at start - "
                        "MemAvailable in /proc/meminfo, or the GPU's free memory - and no bound where unknown)")
    v.add_argument("--max-body-mb", type=positive_float,
                   help="refuse a request body over this many MiB with 413, before reading it whole (default: "
                        "serve.api.MAX_BODY_MB, 8)")
    v.add_argument("--drain-timeout", type=nonneg_float, default=10.0,
                   help="seconds accepted requests may run on after SIGTERM")
    v.add_argument("--speculative", metavar="ngram|mtp|DIR",
                   help="speculative decoding per row: each row drafts tokens by prompt lookup ('ngram': the "
                        "continuation of an earlier occurrence of its last tokens in its prompt and output), from "
                        "the checkpoint's multi-token-prediction head ('mtp'; the model then decodes eagerly) or "
                        "from a smaller model with the same tokenizer (DIR: its run or model folder or .gguf "
                        "file; its state follows the batch's rows), and the batch verifies them in one forward; "
                        "every row's tokens are the ones it would get without it (float weights, int8 with "
                        "AMX / VNNI; other quantised ones within their rounding, which depends on the rows a "
                        "product takes: the README's 'Exactness'; subquad.serve.engine, 'Speculation')")
    v.add_argument("--draft-tokens", type=positive,
                   help=f"tokens drafted per row and step with --speculative (default: {DRAFT_TOKENS})")
    v.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template (as chat_template.jinja) for /v1/chat/completions, in place of the "
                        "model's own: what a run trained here needs to chat (a run folder's own chat_template.jinja "
                        "is read too)")
    v.add_argument("--compile-decode", action="store_true",
                   help="compile the decoding step (subquad.models.decode) before serving and keep, for one row "
                        "and for several, the faster of it and the eager step, timed then (the eager step's C "
                        "kernels of Mamba, Mamba-2 and hybrid blocks often win; printed)")
    v.set_defaults(fn=run)


def positive_float(text: str) -> float:
    """A finite number > 0 (argparse type)."""
    v = nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def api_key(args, environ=os.environ) -> str | None:
    """The API key from one of --api-key, --api-key-file and ``SUBQUAD_API_KEY`` (None: none given). Two of them,
    an empty key or an empty or unreadable file are refused by name: a server meant to be closed must not come up
    open, nor with a key other than the one its operator thinks."""
    given = [(name, v) for name, v in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                                       (KEY_ENV, environ.get(KEY_ENV))) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give the API key one way, not {given[0][0]} and {given[1][0]}")
    if not given:
        return None
    name, value = given[0]
    if name == KEY_ENV:
        value = value.strip()                   # as --api-key-file's: a shell's stray space is not the key
    if name == "--api-key-file":
        try:
            value = Path(value).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot be read ({e})") from None
        name = f"--api-key-file {args.api_key_file}"
    if not value or not value.isprintable():
        raise ValueError(f"{name}: the API key is empty" if not value else
                         f"{name}: the API key holds a control character (a line break?)")
    return value


def run(args) -> int:
    """subquad serve: load the model, build the engine (memory budget: --memory-mb, else half of what is
    available), serve until SIGTERM."""
    check_run_or_model(args)
    key = api_key(args)
    try:
        from subquad.data.tokenizer import end_of_text_ids
        from subquad.serve import Engine
        from subquad.serve.api import MAX_BODY_MB
        from subquad.serve.server import default_memory_mb
        from subquad.serve.server import run as serve_api
    except ImportError as e:
        raise ValueError(f"subquad serve needs the serve extra (pip install 'subquad[serve]'): {e}") from None
    from subquad.models.hf import is_gguf
    from subquad.serve.chat import chat_template_of, load_chat_template
    from subquad.train.run import run_folder

    chat_template, gguf = None, args.model is not None and is_gguf(args.model)
    source = _template_file(args.chat_template)
    folder = run_folder(args.run) if args.run is not None else None if gguf else Path(args.model)
    if folder is not None:
        if args.model is not None and not folder.is_dir():
            raise ValueError(f"--model {args.model} is neither a folder nor a GGUF file")
        chat_template = load_chat_template(folder, source)          # before the load: a bad template fails fast
    check_speculative_flag(args)
    model, tok = load_model(args)
    if gguf:                       # the metadata's template, kept as a folder's tokenizer_config.json (gguf.vocab)
        chat_template = chat_template_of(model.hf_source["files"], source)
    if chat_template is not None and args.run is not None and not chat_template.special_tokens:
        from subquad.data.tokenizer import EOT
        # a run's tokenizer ends its documents with EOT: the template's eos_token
        if tok is not None and tok.token_to_id(EOT) is not None:
            chat_template.special_tokens["eos_token"] = EOT
    speculative = None if args.speculative is None else load_draft(args, model, tok)
    if speculative == "mtp" and getattr(model, "mtp", None) is None:
        raise ValueError(f"--speculative mtp: {args.model or args.run} has no multi-token-prediction head (mtp.* "
                         f"tensors); use 'ngram' or a draft model's folder")
    if args.compile_decode:
        _compile_and_warm(model)
    name = args.served_model_name or Path(args.model or args.run).resolve().name
    memory_mb = default_memory_mb(args.device) if args.memory_mb is None else args.memory_mb or None  # 0: none
    engine = Engine(model, tok, max_batch=args.max_batch, max_queue=args.max_queue, max_context=args.max_context,
                    prefill_chunk=args.prefill_chunk, state_cache_mb=args.state_cache_mb, memory_mb=memory_mb,
                    eos_ids=end_of_text_ids(model, tok), prefix_block=args.prefix_block,
                    speculative=speculative, draft_tokens=args.draft_tokens or DRAFT_TOKENS)
    return serve_api(engine, name, host=args.host, port=args.port, chat_template=chat_template,
                     api_key=key, drain_timeout=args.drain_timeout, max_body_mb=args.max_body_mb or MAX_BODY_MB)


def _template_file(path) -> str | None:
    """``--chat-template FILE``'s Jinja source (None without the flag)."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--chat-template {path}: no such file (a Jinja chat template, as chat_template.jinja)")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template {path}: not UTF-8 text ({e.reason})") from None


def _compile_and_warm(model) -> None:
    """The compiled decoding step (``models.decode``), its graphs built before the first request: one batch row,
    then two rows of different lengths (the batch and any KV cache become dynamic sizes), so requests do not
    wait for a compile; each batch class steps long enough to time the compiled step against the eager one and
    keep the faster (``compile_decode(faster=True)``), which it prints."""
    from subquad.models.decode import CompiledStep, compile_decode

    print("compiling the decoding step (one batch row, then a ragged batch) ...", file=sys.stderr, flush=True)
    compile_decode(model, faster=True)
    eos = model.config.eos_token_ids
    model.config.eos_token_ids = []
    steps = 2 * CompiledStep.TRIAL + 4                  # the trial's 2 * (TRIAL + 1) steps and the prefill's token
    try:
        model.generate([[0, 0, 0]], steps, temperature=0)
        model.generate([[0, 0], [0, 0, 0]], steps, temperature=0)
    finally:
        model.config.eos_token_ids = eos
    chosen = model._decode_step.chosen
    print("decoding step: " + ", ".join(f"{'one row' if k == '1' else 'several rows'} {v}" for k, v in
                                        sorted(chosen.items())) + " (the faster of the two, timed)",
          file=sys.stderr, flush=True)
