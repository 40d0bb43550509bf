"""Plain-text tables (no dependency): the CLI prints them, RESULTS.md embeds them."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n}"


def render(rows: list[dict], columns: list[str] | None = None, markdown: bool = False) -> str:
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    if markdown:
        head = "| " + " | ".join(columns) + " |"
        sep = "|" + "|".join("---" for _ in columns) + "|"
        return "\n".join([head, sep] + ["| " + " | ".join(row) + " |" for row in cells])
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)
