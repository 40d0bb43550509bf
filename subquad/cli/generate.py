"""``subquad generate``: stream text from a run or a model folder with its constant-size state; save and
load the state to continue later."""

from __future__ import annotations

import sys

from subquad.cli.common import add_model_flags, check_folder_of, check_run_or_model, load_model, positive

DRAFT_TOKENS = 4        # tokens drafted per step when --draft-tokens is not given

def add_parser(command, hf_types: list[str]) -> None:
    g = command("generate", "stream text from a trained run with its recurrent state")
    add_model_flags(g, hf_types, model_help=(
        "a Hugging Face model folder (config.json, model.safetensors, tokenizer.json) of a supported type: "
        f"{', '.join(hf_types)}; or a BlinkDL RWKV-7 .pth file (its world vocabulary rwkv_vocab_v20230424.txt "
        "beside it); or a GGUF file (llama.cpp's mamba, mamba2, lfm2, lfm2moe, rwkv7, kimi-linear, qwen3next, "
        "qwen35, qwen35moe, granitehybrid, nemotron_h, nemotron_h_moe, falcon-h1, jamba, minimax-01; its tokenizer "
        "from the file's metadata)"))
    g.add_argument("--prompt", help="text to continue (required, unless --prompts-file or --load-state)")
    g.add_argument("--prompts-file", help="a file of prompts, one per line: all generated as one batch")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    g.add_argument("--top-k", type=positive, help="sample among the k most likely tokens (default: all)")
    g.add_argument("--top-p", type=float, help="sample within the nucleus of this mass (default: all)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a sequence where its text holds TEXT, matched on the decoded text across tokens and "
                        "left out of the output, as the server's 'stop' (backslash escapes read: '\\n'; a special "
                        "token such as '</s>' ends it at that token; repeatable; default: none). --save-state "
                        "keeps every token generated, the stop text's included")
    g.add_argument("--min-p", type=float, help="drop tokens less likely than this times the most likely (vLLM)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token generated so far (OpenAI; -2..2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times its count from the logit of every token generated so far (OpenAI; -2..2)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the positive logits, multiply the negative ones, of every token in the prompt or "
                        "generated so far by this (Hugging Face, vLLM; 1: none)")
    g.add_argument("--logit-bias", action="append", default=None, metavar="ID=VALUE",
                   help="add VALUE (-100..100) to token ID's logit (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=None, metavar="ID",
                   help="end a sequence at this token id, its text left out (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-text tokens")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--save-state", help="write the decoding state here (safetensors) to continue later")
    g.add_argument("--load-state", help="continue from a state saved with --save-state")
    g.add_argument("--compile-decode", action="store_true",
                   help="compile the one-token step (subquad.models.decode; seconds per kind of layer) and keep, "
                        "for one row and for several, the faster of it and the eager step, timed over the first "
                        "steps (the eager step's C kernels of Mamba, Mamba-2 and hybrid blocks often win)")
    g.add_argument("--speculative", metavar="ngram|mtp|DIR",
                   help="speculative decoding: draft tokens by prompt lookup ('ngram': the continuation of an earlier "
                        "match of the last few tokens), with the checkpoint's own multi-token-prediction head "
                        "('mtp': Qwen3-Next, Qwen3.5, Nemotron-H, Ling 3) or with a smaller model of the same "
                        "tokenizer (DIR: a run or model folder or a .gguf file, loaded with --device; a model "
                        "folder or file with --dtype too), and verify them in one forward; the same output as "
                        "without")
    g.add_argument("--draft-tokens", type=positive, help=f"tokens drafted per step with --speculative (default: "
                                                          f"{DRAFT_TOKENS})")
    g.add_argument("--json", action="store_true",
                   help="answer with a JSON object (OpenAI's response_format json_object; needs llguidance: "
                        "pip install 'subquad[grammar]')")
    g.add_argument("--json-schema", metavar="FILE",
                   help="answer with JSON valid under the JSON schema in FILE (response_format json_schema)")
    g.set_defaults(fn=run)


def unescape(text: str) -> str:
    """Backslash escapes as Python writes them (``--stop '\\n'`` is a newline); every other character, non-ASCII
    included, stays itself (``unicode_escape`` alone reads UTF-8 bytes as Latin-1: "é" became "Ã©")."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def stop_texts(texts) -> list[str]:
    """The --stop texts with their backslash escapes read; an empty one is refused."""
    out = [unescape(t) for t in texts or []]
    if any(not t for t in out):
        raise ValueError("--stop: an empty text would end every sequence at once; give at least one character")
    return out


def special_stops(tok, texts) -> tuple[list[str], list[int]]:
    """(the --stop texts matched on the decoded text, the ids of those that are one special token): the
    decoded text leaves special tokens out ("</s>", "<|im_end|>"), so such a text stops at its token, as
    --stop-token-id; a text holding one beside other text is refused by name."""
    plain, ids = [], []
    for text in texts:
        enc = tok.encode(text, add_special_tokens=False).ids     # the text's own tokens, no BOS / EOS added
        silent = [t for t in enc if tok.decode([t]) == ""]
        if silent and len(enc) == 1:
            ids += enc
        elif silent:
            raise ValueError(f"--stop {text!r} holds a special token (id {silent[0]}), which the decoded text "
                             f"leaves out: give it alone, or as --stop-token-id {silent[0]}")
        else:
            plain.append(text)
    return plain, ids


class StopText:
    """A sequence's text as its tokens come (``serve.text.TextStream``, the server's): ``push(id)`` -> (the
    newly released text, whether a --stop text was reached); ``rest()`` the text held back at the end. A token
    of ``stop_ids`` (--stop-token-id, a special --stop) adds no text - generate ends the sequence at it - as
    the server leaves a stop token's text out."""

    def __init__(self, tok, stops, stop_ids=()):
        from subquad.serve.text import TextStream

        self.ids, self.stream, self.stopped = [], TextStream(tok.decode, stops), False
        self.stop_ids = set(stop_ids)

    def push(self, t: int) -> tuple[str, bool]:
        if t in self.stop_ids:
            return "", False
        self.ids.append(t)
        text, self.stopped = self.stream.push(self.ids)
        return text, self.stopped

    def rest(self) -> str:
        return "" if self.stopped else self.stream.flush()


def logit_bias(items) -> dict[int, float] | None:
    """--logit-bias ID=VALUE items -> {id: value} (values are checked by ``SamplingOptions``)."""
    out = {}
    for item in items or []:
        tid, sep, value = item.partition("=")
        try:
            out[int(tid)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias {item!r}: write ID=VALUE, e.g. 50256=-100") from None
        if not sep:
            raise ValueError(f"--logit-bias {item!r}: write ID=VALUE, e.g. 50256=-100")
    return out or None


def sampling(args, stop_ids=()) -> dict:
    """The ``generate`` keyword arguments of the sampling flags (checked there, by ``SamplingOptions``), with
    ``stop_ids`` (special --stop texts' ids) beside --stop-token-id's."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                stop_ids=(args.stop_token_id or []) + list(stop_ids), min_p=args.min_p,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                logit_bias=logit_bias(args.logit_bias), ignore_eos=args.ignore_eos)


def check_sampling_flags(args) -> None:
    """Refuse a bad sampling flag by name before the model loads (``SamplingOptions``' check)."""
    from subquad.models.sampling import OptionError, SamplingOptions

    kw = sampling(args)
    kw.pop("seed")
    try:
        SamplingOptions(**kw)
    except OptionError as e:
        flag = {"stop_ids": "--stop-token-id"}.get(e.name, "--" + e.name.replace("_", "-"))
        raise ValueError(f"{flag}: {e}") from None


def check_speculative_flag(args) -> None:
    """--speculative is 'ngram', 'mtp', a folder or a GGUF file that exists (checked before the model loads)."""
    from pathlib import Path

    from subquad.models.hf import is_gguf

    spec = args.speculative
    if spec not in (None, "ngram", "mtp") and not Path(spec).is_dir() \
            and not (Path(spec).is_file() and is_gguf(spec)):
        raise ValueError(f"--speculative must be 'ngram', 'mtp' or a draft model's folder (a run or a model "
                         f"folder) or .gguf file; {spec} is neither")
    if spec is None and args.draft_tokens is not None:
        raise ValueError("--draft-tokens goes with --speculative (it sets how many tokens are drafted)")


def load_draft(args, model, tok=None):
    """--speculative's drafter for ``generate``: 'ngram', 'mtp', or the draft model of a run folder (or one of
    its checkpoints), a model folder or a GGUF file - refused unless its vocabulary is the model's (``tok``'s, where
    both have a tokenizer; else its size)."""
    import argparse

    from subquad.train import run_folder

    if args.speculative in ("ngram", "mtp"):
        return args.speculative
    hf = run_folder(args.speculative) is None          # a run's config.json is not a model folder's
    draft_args = argparse.Namespace(**{**vars(args), "run": None if hf else args.speculative,
                                       "model": args.speculative if hf else None})
    draft, draft_tok = load_model(draft_args)
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"--speculative {args.speculative}: its vocab_size ({draft.config.vocab_size}) is not the "
                         f"model's ({model.config.vocab_size}); a draft model needs the same tokenizer")
    ours, theirs = _tokens(tok), _tokens(draft_tok)
    if ours is not None and theirs is not None and ours != theirs:     # the same size, other tokens
        raise ValueError(f"--speculative {args.speculative}: its tokenizer is not the model's (the same "
                         f"{draft.config.vocab_size} ids stand for other tokens); a draft model needs the same "
                         "tokenizer")
    return draft


def _tokens(tok) -> dict | None:
    """A ``tokenizers.Tokenizer``'s vocabulary without its added tokens (reserved special slots may be named
    apart), or None (no tokenizer, or RWKV's world tokenizer: compared by size alone)."""
    return tok.get_vocab(with_added_tokens=False) if hasattr(tok, "get_vocab") else None


def response_format(args) -> dict | None:
    """--json / --json-schema FILE as ``generate``'s response_format (checked there)."""
    import json
    from pathlib import Path

    if args.json and args.json_schema:
        raise ValueError("give one of --json and --json-schema")
    if args.json:
        return {"type": "json_object"}
    if args.json_schema is None:
        return None
    path = Path(args.json_schema)
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: not a readable JSON file ({e})") from None
    return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}


def report_speculation(model, args) -> None:
    """With --speculative: tokens per model forward and the drafts' acceptance, on stderr."""
    st = getattr(model, "speculation_stats", None)
    if args.speculative and st is not None:
        name = args.speculative if args.speculative in ("ngram", "mtp") else f"draft model {args.speculative}"
        print(f"[speculative {name}: {st.tokens_per_step:.2f} tokens per step over {st.steps} steps "
              f"({st.verifications} verifying drafts), {st.accepted}/{st.drafted} drafted tokens accepted]",
              file=sys.stderr)


def cut_json(fmt, out: list[int], args, tok, which: str = "") -> None:
    """With --json / --json-schema: a warning on stderr when --max-new-tokens ended the output before the grammar
    did (the JSON printed is incomplete; the server says finish_reason "length")."""
    import json

    if fmt is None or len(out) < args.max_new_tokens:
        return
    try:
        json.loads(tok.decode(out))
    except ValueError:
        print(f"warning: {which}JSON was cut off by --max-new-tokens {args.max_new_tokens} before it was complete "
              "(ask for more tokens)", file=sys.stderr)


def report_compiled(model) -> None:
    """With --compile-decode: the step each batch class kept and the two steps' best trial times, on stderr."""
    step = getattr(model, "_decode_step", None)
    if step is None or step.trial is None:
        return
    for key, times in step.trial.items():
        rows = "one row" if key == "1" else "several rows"
        if key in step.chosen:
            eager, compiled = (1e3 * min(times[k]) for k in ("eager", "compiled"))
            print(f"[compile-decode, {rows}: kept the {step.chosen[key]} step (eager {eager:.2f} ms, compiled "
                  f"{compiled:.2f} ms a step)]", file=sys.stderr)
        else:
            print(f"[compile-decode, {rows}: no step chosen: the trial needs {2 * step.TRIAL + 2} steps, "
                  f"{times['calls']} were taken]", file=sys.stderr)


def run(args) -> int:
    from pathlib import Path

    import torch

    from subquad.models import load_state, save_state
    from subquad.models.state import check_fits, live_bytes

    check_run_or_model(args)
    if args.prompts_file:
        if args.load_state or args.save_state or args.prompt:
            raise ValueError("--prompts-file generates a batch; it does not combine with --prompt, --load-state "
                             "or --save-state")
        path = Path(args.prompts_file)
        if not path.exists():
            raise ValueError(f"--prompts-file {path} does not exist")
        lines = [(n, ln) for n, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
        prompts = [ln for _, ln in lines]
        if not prompts:
            raise ValueError(f"--prompts-file {path} holds no prompt (one per line)")
    if args.save_state:
        check_folder_of("--save-state", args.save_state)                 # refused before the model loads
    check_sampling_flags(args)
    stops = stop_texts(args.stop)
    check_speculative_flag(args)
    fmt = response_format(args)                       # a bad --json-schema file is refused before the model loads
    model, tok = load_model(args, need_tokenizer="to encode the prompt with")
    if args.compile_decode:
        from subquad.models.decode import compile_decode

        compile_decode(model, faster=True)              # each batch class keeps the faster of the two steps
    stops, special = special_stops(tok, stops)
    if not args.ignore_eos and not model.config.eos_token_ids:      # a run names none: its <|endoftext|>, as the
        from subquad.data.tokenizer import end_of_text_ids           # server stops there

        special += end_of_text_ids(model, tok)
    ends = (args.stop_token_id or []) + special         # tokens that end a sequence, their text left out
    speculation = {} if args.speculative is None else {"speculative": load_draft(args, model, tok),
                                                        "draft_tokens": args.draft_tokens or DRAFT_TOKENS}
    if fmt is not None:
        speculation.update(response_format=fmt, tokenizer=tok)
    if args.prompts_file:
        texts = [StopText(tok, stops, ends) for _ in prompts]
        outs, _ = model.generate([tok.encode(p).ids or [0] for p in prompts], args.max_new_tokens,
                                 on_token=lambda i, t: texts[i].push(t)[1], **sampling(args, special), **speculation)
        for (n, p), text, out in zip(lines, texts, outs, strict=True):   # named by line: blank lines are skipped
            print(f"--- [line {n}] {p}{text.stream.text}{text.rest()}")
            cut_json(fmt, out, args, tok, f"line {n}'s ")
        report_speculation(model, args)
        return 0
    state = None
    if args.load_state:
        state, extra = load_state(args.load_state)
        check_fits(state, model, f"--load-state {args.load_state}")
        ids = [extra["last_token"]] + (tok.encode(args.prompt, add_special_tokens=False).ids   # mid-sequence: no BOS
                                       if args.prompt else [])
    else:
        if args.prompt is None:
            print("error: --prompt is required (or --prompts-file, or --load-state to continue a saved generation)",
                  file=sys.stderr)
            return 2
        if not args.prompt:
            print("error: --prompt is empty: give the text to continue", file=sys.stderr)
            return 2
        ids = tok.encode(args.prompt).ids
    echo = [args.prompt or ""]      # printed with the first token (a refused option prints alone); after a loaded
    # state, the text --prompt appends
    text = StopText(tok, stops, ends)    # whole characters only; a possible stop text's start held back

    def stream(t):
        shown, stopped = text.push(t)
        print(echo.pop() if echo else "", shown, sep="", end="", flush=True)
        return stopped

    if args.max_new_tokens == 0 and args.save_state:   # the saved state stops before the last token it keeps
        with torch.no_grad():
            out, state = [], (model.prefill(torch.tensor([ids[:-1]], device=model.embed.weight.device), state,
                                            logits="last")[1] if len(ids) > 1
                              else state if state is not None else model.empty_state(1))
    else:
        out, state = model.generate(ids, args.max_new_tokens, state=state, on_token=stream,
                                    **sampling(args, special), **speculation)
    print(echo.pop() if echo else "", text.rest(), sep="")
    cut_json(fmt, out, args, tok)
    report_speculation(model, args)
    report_compiled(model)
    print(f"\n[state: {live_bytes(state):,} bytes over {model.config.n_layers} layers "
          f"({', '.join(sorted(set(model.config.layers)))})]", file=sys.stderr)
    if args.save_state:
        save_state(args.save_state, state, {"last_token": out[-1] if out else ids[-1]})
        print(f"[state saved to {args.save_state}; continue with --load-state]", file=sys.stderr)
    return 0
