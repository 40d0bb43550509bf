"""subquad models in EleutherAI's lm-evaluation-harness (the ``eval`` extra installs it, pinned).

    python -m subquad.harness --model subquad --model_args path=DIR_OR_RUN,dtype=bfloat16 --tasks hellaswag
    subquad eval --model DIR_OR_RUN --tasks hellaswag [--limit N] [--include-path DIR]

``SubquadLM`` is lm_eval's ``LM`` (registered as "subquad" when this module is imported; lm_eval's own
``lm_eval`` command does not discover plugins, so ``python -m subquad.harness`` is that command with the
registration done first). ``path`` is a Hugging Face folder (``from_pretrained``) or a subquad run
(``load_run``). It scores requests as lm_eval's ``hf`` backend does, with the same tokenisation (the
continuation's tokens are those the context + continuation string adds to the context's own; a context
that ends in spaces gives them to the continuation; an empty context is the begin-of-text token, or
end-of-text where the tokenizer names none):

    loglikelihood(c, x)      sum_i log p(x_i | c, x_<i), and whether every x_i is the greedy token
    loglikelihood_rolling(s) sum_i log p(s_i | bos, s_<i)  - the whole text in one pass with the state
                             carried through pieces (no windows: a recurrent model reads it all)
    generate_until(c, kw)    greedy (or sampled, ``do_sample``) tokens until a stop string or max_gen_toks

The fixed state's advantage: the requests that share a context (a multiple-choice question's choices) are
scored from one prefill of it - the contexts of a batch packed in one row (``cu_seqlens``), their states
copied to one row per continuation (``models.rows.select_rows``), and every continuation run from there
in one padded call - where the ``hf`` backend reads the context once per choice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import lm_eval.models  # noqa: F401 - lm_eval fills its registry lazily only while it is empty: fill it first
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from subquad.models.rows import select_rows


def load(path, dtype=None, device="cpu", quantize=None, group_size=None):
    """(model, tokenizer, end-of-text id, prefix id) from a Hugging Face folder or a subquad run folder. The
    prefix (what an empty context and a rolling text start from) is the begin-of-text token where the
    tokenizer names one, else end-of-text, as lm_eval's hf backend takes it."""
    p = Path(path)
    from subquad.train.run import load_run, run_folder

    if run_folder(p) is not None:
        from subquad.data.tokenizer import EOT

        model, tok, _ = load_run(p, device=device, quantize=quantize, group_size=group_size)
        if dtype is not None:
            model.to(dtype)
        return model, tok, tok.token_to_id(EOT), tok.token_to_id(EOT)
    from subquad.models import from_pretrained

    model, tok = from_pretrained(p, dtype=dtype, device=device, quantize=quantize, group_size=group_size)
    if tok is None:
        raise ValueError(f"{p} has no tokenizer.json: lm_eval's requests are text")
    conf = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").exists() else {}

    def special(key):                                      # what transformers' tokenizer calls eos_token, bos_token
        name = conf.get(key)
        name = name.get("content") if isinstance(name, dict) else name
        return None if name is None else tok.token_to_id(name)

    eot, bos = special("eos_token"), special("bos_token")
    if eot is None and model.config.eos_token_ids:
        eot = model.config.eos_token_ids[0]
    if eot is None:
        raise ValueError(f"{p}: no end-of-text token (tokenizer_config.json's eos_token or config's eos_token_id)")
    return model, tok, eot, (eot if bos is None else bos)


@register_model("subquad")
class SubquadLM(LM):
    """lm_eval's ``LM`` over a subquad model (module docstring). ``batch_size``: contexts per packed prefill."""

    def __init__(self, path, dtype=None, device="cpu", quantize=None, batch_size=16, piece=2048,
                 max_gen_toks=256, group_size=None):
        super().__init__()
        from subquad.models.hf.loader import resolve_dtype

        self.model, self.tok, self.eot, self.prefix = load(path, resolve_dtype(dtype), device, quantize,
                                                                 None if group_size is None else int(group_size))
        self.batch_size = int(batch_size)
        self.piece = int(piece)
        self.max_gen_toks = int(max_gen_toks)
        self.dev = self.model.embed.weight.device
        self.context_prefills = 0                      # contexts read, for the state-reuse measurement

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        return cls.create_from_arg_obj(dict(kv.split("=", 1) for kv in arg_string.split(",") if kv), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """``--model_args`` first; of lm_eval's own settings only ``device`` (its default "cuda:0" falls back to
        the CPU where there is no GPU, as its hf backend does) and a numeric ``batch_size``."""
        extra = {k: v for k, v in (additional_config or {}).items() if k in ("batch_size", "device") and v is not None}
        if not str(extra.get("batch_size", "1")).isdigit():
            extra.pop("batch_size")                   # "auto": ours
        if str(extra.get("device", "cpu")).startswith("cuda") and not torch.cuda.is_available():
            extra.pop("device")                       # lm_eval's default "cuda:0" on a machine without one: the CPU
        return cls(**{**extra, **arg_dict})

    # -- tokenisation, as lm_eval's hf backend ------------------------------------------------------------

    def _encode(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context == "":
            return [self.prefix], self._encode(continuation)
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return ctx, whole[len(ctx):]

    # -- scoring ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p, all greedy) per (context, continuation) pair; contexts shared by pairs are read once."""
        groups: dict[tuple, list[int]] = {}
        for i, (ctx, _) in enumerate(pairs):
            groups.setdefault(tuple(ctx), []).append(i)
        out: list = [None] * len(pairs)
        contexts = list(groups)
        for s in range(0, len(contexts), self.batch_size):
            batch = contexts[s:s + self.batch_size]
            lens = [len(c) for c in batch]
            ids = torch.tensor([t for c in batch for t in c], device=self.dev).view(1, -1)
            cu = torch.tensor([0] + lens, device=self.dev).cumsum(0)
            logits, state = self.model.prefill(ids, cu_seqlens=cu)          # every context once, packed
            self.context_prefills += len(batch)
            last = logits[0, cu[1:] - 1].float()                           # each context's next-token logits
            rows = [(g, i) for g, c in enumerate(batch) for i in groups[c]]
            conts = [pairs[i][1] for _, i in rows]
            L = max(len(c) for c in conts)
            tokens = torch.tensor([c + [0] * (L - len(c)) for c in conts], device=self.dev)
            if L > 1:                                                     # continuations from their context's state
                cont_logits, _ = self.model.prefill(tokens[:, :-1], select_rows(state, [g for g, _ in rows]))
            for r, ((g, i), c) in enumerate(zip(rows, conts)):
                lg = last[g:g + 1] if len(c) == 1 else torch.cat([last[g:g + 1], cont_logits[r, :len(c) - 1].float()])
                logp = F.log_softmax(lg, -1)
                target = tokens[r, :len(c)]
                out[i] = (logp.gather(-1, target[:, None]).sum().item(), bool((lg.argmax(-1) == target).all()))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._score([self._pair(*r.args) for r in requests])

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for r in requests:
            ids = [self.prefix] + self._encode(r.args[0])
            total, state = 0.0, None
            for s in range(0, len(ids) - 1, self.piece):
                x = torch.tensor(ids[s:s + self.piece], device=self.dev).view(1, -1)
                y = torch.tensor(ids[s + 1:s + 1 + self.piece], device=self.dev)
                logits, state = self.model.prefill(x[:, :len(y)], state)
                total += F.log_softmax(logits[0].float(), -1).gather(-1, y[:, None]).sum().item()
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        for r in requests:
            context, kw = r.args
            kw = dict(kw or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kw.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            prompt = self._encode(context) or [self.prefix]
            tokens, _ = self.model.generate(prompt, n, temperature=temperature, stop_ids=[self.eot])
            text = self.tok.decode([t for t in tokens if t != self.eot])
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
        return out


def main(argv=None) -> None:
    """lm_eval's own command line with ``--model subquad`` registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
