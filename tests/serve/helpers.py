"""Tiny random checkpoints for the serve tests (nothing downloaded) and a real server in a subprocess.

``folder(...)`` writes a Hugging Face folder of a subquad model - a pure recurrent one (``mamba2``) or a
hybrid with an attention layer (``bamba``: Mamba-2, softmax, Mamba-2) - with a word-level tokenizer
(token i is the word "w<i>", or a special token), optionally a chat template and end-of-text id.
``Server`` runs ``subquad serve`` on 127.0.0.1 in a subprocess and stops it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from subquad.models import LanguageModel, ModelConfig, from_pretrained

V = 96
SPECIALS = {"<|user|>": 2, "<|assistant|>": 3, "<|system|>": 4}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {{ eos_token }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REPO = Path(__file__).resolve().parents[2]


def config(kind: str) -> ModelConfig:
    if kind == "mamba2":                       # pure recurrent: Mamba-2 layers, no MLP (Mamba2ForCausalLM)
        return ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, pattern="mamba2", mlp=False,
                           mixer_options={"mamba2": {"norm_eps": 1e-6}}, tie_embeddings=False)
    if kind == "bamba":                        # hybrid: Mamba-2, attention (GQA, partial rotary), Mamba-2
        return ModelConfig(vocab_size=V, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                           pattern="mamba2,softmax,mamba2",
                           mixer_options={"softmax": {"rotary_fraction": 0.5}, "mamba2": {"norm_eps": 1e-6}},
                           tie_embeddings=False)
    if kind == "qwen4_exp":                    # hyper-connections, PLE (token and convolution state), QSA's caches
        ple = {"layers": [0], "dim": 8, "eos": 1, "ngram": 3, "heads_per_ngram": 2, "vocab_base": 20,
               "vocab_multiple": 4}
        return ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, pattern="gated_deltanet,qsa",
                           hyper={"streams": 2, "rank": 4, "ple": ple}, tie_embeddings=False,
                           mixer_options={"qsa": {"index_heads": 2, "index_head_dim": 16, "index_budget": 4,
                                                  "index_block": 2}})
    raise ValueError(kind)


def word(i: int, eos: int | None) -> str:
    if i == eos:
        return "</s>"
    return next((s for s, j in SPECIALS.items() if j == i), f"w{i}")


def folder(path: Path, kind: str, template: bool = False, eos: int | None = None, seed: int = 0) -> Path:
    """A model folder: config.json (with ``eos``), model.safetensors, tokenizer.json, tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    model = LanguageModel(config(kind))
    model.config.eos_token_ids = [] if eos is None else [eos]
    model.save_pretrained(path)
    vocab = {word(i, eos): i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w10"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [w for w in vocab if w.startswith("<")]
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in specials])
    tok.save(str(path / "tokenizer.json"))
    tc = {"eos_token": "</s>" if eos is not None else None}
    if template:
        tc["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return path


def load(path):
    model, tok = from_pretrained(path)
    return model, tok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port`` (Linux's /proc; True where it
    cannot be read): a free port found by two test workers at once is bound by one of them only, and the other's
    server must not take the first one's /health for its own."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return True
    mine = set()
    for fd in fds:
        try:
            mine.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:                                   # closed meanwhile: not the listening socket
            pass
    here = {f"{a}:{port:04X}" for a in ("0100007F", "7F000001")}                # 127.0.0.1, either byte order
    for line in lines:
        f = line.split()
        if f[1] in here and f[3] == "0A":                                       # LISTEN
            return f"socket:[{f[9]}]" in mine
    return False


class Server:
    """``subquad serve --model FOLDER ARGS`` on 127.0.0.1 (a free port), up when the constructor returns; a port
    another worker's server took first is given up for another (at most 5 tries)."""

    def __init__(self, model_folder, *args, timeout: float = 60.0):
        self.model_name = Path(model_folder).name
        for _ in range(5):
            if self._start(model_folder, args, timeout):
                return
        raise RuntimeError("the server found no free port in 5 tries")

    def _start(self, model_folder, args, timeout: float) -> bool:
        """Start on a free port; True when up, False when the port was taken before it bound it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "subquad", "serve", "--model", str(model_folder),
                                      "--port", str(self.port), *map(str, args)], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read()
                self.proc.stdout.close()
                if "address already in use" in out.lower():
                    return False
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{out}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200 and listens(self.proc.pid, self.port):
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the server did not come up")

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return {ln.split()[0].removeprefix("subquad_"): float(ln.split()[1])
                for ln in text.splitlines() if ln and not ln.startswith("#")}

    def client(self, api_key="none", **kw):
        """An openai client of this server. Its read timeout (120 s by default) bounds a hung request, not speed:
        32 concurrent streams on two loaded cores once waited more than 30 s between chunks."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()
