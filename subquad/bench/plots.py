"""Figures (PNG) for the workshop and benchmarks. matplotlib with the Agg backend: no screen needed."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def memory_panel(ax, rows: list[dict], head_dim: int, dtype: str):
    T = [r["context"] for r in rows]
    ax.loglog(T, [r["kv_bytes"] for r in rows], "o-", color="tab:blue", label="softmax KV cache (2Td)")
    ax.loglog(T, [r["state_bytes"] for r in rows], "s-", color="tab:red", label="linear state (d²+d)")
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel(f"bytes per layer and head ({dtype})")
    ax.set_title(f"Memory against context, d = {head_dim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def loss_panel(ax, curves: dict[str, list[tuple[int, float]]]):
    colors = {"softmax": "tab:blue", "linear": "tab:red"}
    for name, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", label=name, color=colors.get(name.split()[0]))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("Held-out loss")
    ax.grid(True, alpha=0.3)
    ax.legend()


def workshop_figure(path, memory_rows, head_dim, dtype, curves=None):
    panels = 2 if curves else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    axes = [axes] if panels == 1 else list(axes)
    memory_panel(axes[0], memory_rows, head_dim, dtype)
    if curves:
        loss_panel(axes[1], curves)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mixer_states_figure(path, rows: list[dict], d_model: int, n_heads: int, dtype: str):
    """Each mixer's decoding state per layer (``bench.memory.mixer_states``) against context, log-log."""
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    for i, r in enumerate(rows):
        T = sorted(r["bytes"])
        style = "o-" if r["per_token"] else "s--"
        ax.loglog(T, [r["bytes"][t] for t in T], style, ms=3, color=f"C{i % 10}", label=r["mixer"])
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel(f"bytes per layer, one sequence ({dtype} layers)")
    ax.set_title(f"Decoding state per layer, d_model {d_model}, {n_heads} heads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
