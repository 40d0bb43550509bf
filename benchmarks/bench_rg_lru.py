"""The RG-LRU against transformers' RecurrentGemma RG-LRU module (``RecurrentGemmaRglru``, its token loop).

Both compute the same thing from the same parameters: the block-diagonal input and recurrence gates, the log-decay
-8 r softplus(Lambda), the reset at position 0 and the recurrence h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t);
subquad's recurrence is ``subquad.ops.rg_lru`` (the chunk form: Mamba's lanes). lru_width 1024 in 8 heads, B=1,
float32, 2 threads, T = 1K, 4K and 16K, forward and forward+backward (transformers' backward through its token loop
only at 1K: it takes minutes at 4K); the outputs are checked equal first.
Writes results/rg_lru.{json,md}.

    python benchmarks/bench_rg_lru.py            # ~2 minutes
    python benchmarks/bench_rg_lru.py --quick
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_line, parse_args, ratio, run_cases, speed_tables, target_lines  # noqa: E402
from subquad.ops import rg_lru  # noqa: E402

WIDTH, HEADS = 1024, 8


def hf_module():
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    torch.manual_seed(0)
    m = RecurrentGemmaRglru(RecurrentGemmaConfig(hidden_size=WIDTH, lru_width=WIDTH, num_attention_heads=HEADS))
    with torch.no_grad():
        for p in (m.input_gate_weight, m.recurrent_gate_weight):
            p.normal_(0, (0.01 / (WIDTH // HEADS)) ** 0.5)
        for p in (m.input_gate_bias, m.recurrent_gate_bias):
            p.normal_(0, 0.1)
        m.recurrent_param.uniform_(-4.0, 1.0)
    return m


def ours(m):
    """The same RG-LRU from ``m``'s parameters, its recurrence by ``rg_lru``."""
    def run(x):
        B, T, _ = x.shape
        xh = x.view(B, T, HEADS, -1)
        gi = torch.sigmoid(torch.einsum("bthi,hij->bthj", xh, m.input_gate_weight) + m.input_gate_bias)
        gr = torch.sigmoid(torch.einsum("bthi,hij->bthj", xh, m.recurrent_gate_weight) + m.recurrent_gate_bias)
        g = -8.0 * gr * F.softplus(m.recurrent_param).view(HEADS, -1)
        g = torch.cat([torch.full_like(g[:, :1], float("-inf")), g[:, 1:]], 1)      # position 0: the reset
        return rg_lru(xh * gi, g)[0].reshape(B, T, -1)
    return run


def theirs(m):
    def run(x):
        m.recurrent_states = None
        return m(x, torch.arange(x.shape[1])[None])
    return run


def main(argv=None):
    args = parse_args(__doc__, argv)
    lengths, repeats, budget = ([256], 1, 2.0) if args.quick else ([1024, 4096, 16384], 3, 20.0)
    m = hf_module()
    x = torch.randn(1, lengths[-1], WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(ours(m)(x), theirs(m)(x), rtol=1e-4, atol=1e-5)

    def make(T):
        return [torch.randn(1, T, WIDTH)]

    cs = {"rg_lru (subquad, chunk)": (make, ours(m), 1 << 16, 1 << 16),
          "transformers RecurrentGemmaRglru": (make, theirs(m), 1 << 16, 1 << 10)}   # its backward: minutes at 4K
    machine = machine_line()
    rows = run_cases(cs, lengths, repeats, budget)
    tg = [{"what": f"rg_lru vs transformers, {key}, T={T:,}", "value": f"{r:.1f}x", "target": ">= 3x", "met": r >= 3}
          for T in lengths for key in ("fwd", "fwdbwd")
          if (r := ratio(rows, T, *cs, key)) is not None]
    md = [f"Machine: {machine}", ""]
    md += speed_tables(rows, f"RG-LRU with its gates, lru_width {WIDTH}, {HEADS} heads, B=1, float32")
    md += ["**Targets (this run)**", ""] + target_lines(tg)
    (args.out / f"rg_lru{args.suffix}.json").write_text(json.dumps({"rows": rows, "targets": tg}, indent=2))
    (args.out / f"rg_lru{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
