"""The token-region diagram of the site, drawn as SVG at build time.

One worked example (block size, window, hit lengths below) is computed with the
formulas of ``docs/regions.md`` and drawn: the token regions of one request at
one scheduling step, and the block table each KV cache group ends up with, on
vLLM 0.13.0 and with the series. Nothing is fetched at view time.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swa_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    """SlidingWindowManager.get_num_skipped_tokens: tokens no layer reads again."""
    return max(0, num_computed_tokens - sliding_window + 1)


@dataclass(frozen=True)
class Example:
    block_size: int = 4
    sliding_window: int = 8
    cached: int = 12  # local prefix-cache hit, tokens
    external: int = 16  # connector hit, tokens
    new: int = 8  # computed this step
    lookahead: int = 4  # speculative slots

    @property
    def computed(self) -> int:
        return self.cached + self.external

    @property
    def total(self) -> int:
        return self.computed + self.new + self.lookahead

    @property
    def num_blocks(self) -> int:
        return cdiv(self.total, self.block_size)

    @property
    def skipped(self) -> int:
        return swa_skipped_tokens(self.computed, self.sliding_window)

    def region(self, token: int) -> str:
        if token < self.cached:
            return "cached"
        if token < self.computed:
            return "external"
        if token < self.computed + self.new:
            return "new"
        return "lookahead"

    def tables(self) -> dict[str, list[str]]:
        """Per row, the kind of each block: a region, "null" or "freed"."""
        b = self.block_size
        kinds = [self.region(i * b) for i in range(self.num_blocks)]
        skipped_blocks = self.skipped // b
        # 0.13.0: the SWA hit keeps its last cdiv(W-1, B) blocks (null-padded);
        # every external token gets a block; out-of-window blocks are freed by
        # remove_skipped_blocks one step later.
        hit_blocks = self.cached // b
        contiguous = cdiv(self.sliding_window - 1, b)
        legacy = []
        for i, kind in enumerate(kinds):
            if kind == "cached" and i < hit_blocks - contiguous:
                legacy.append("null")
            elif i < skipped_blocks:
                legacy.append("freed")
            else:
                legacy.append(kind)
        series = ["null" if i < skipped_blocks else k for i, k in enumerate(kinds)]
        return {
            "full attention": kinds,
            "sliding window, vLLM 0.13.0": legacy,
            "sliding window, series": series,
        }


COLORS = {
    "cached": "#4f7fd9",
    "external": "#e8913a",
    "new": "#3fa34d",
    "lookahead": "#9a6bc9",
    "skipped": "#9aa0a6",
}
LABELS = {
    "cached": "cached (local hit)",
    "external": "external (connector)",
    "new": "new (this step)",
    "lookahead": "lookahead (spec)",
}


def regions_svg(ex: Example | None = None) -> str:
    ex = ex or Example()
    cell, label_w, pad = 44, 170, 8
    tok = cell / ex.block_size
    width = label_w + ex.num_blocks * cell + 2 * pad
    out: list[str] = []

    def text(x, y, s, size=12, anchor="start", weight="normal", fill="#202124"):
        out.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}">{escape(s)}</text>'
        )

    x0 = label_w + pad
    y = 22
    text(pad, y + 17, "token regions", weight="bold")
    start = 0
    for kind, n in (
        ("cached", ex.cached),
        ("external", ex.external),
        ("new", ex.new),
        ("lookahead", ex.lookahead),
    ):
        out.append(
            f'<rect x="{x0 + start * tok:.1f}" y="{y}" width="{n * tok:.1f}" '
            f'height="26" fill="{COLORS[kind]}" stroke="#fff"/>'
        )
        label = f"{kind} {n}" if n * tok >= 90 else str(n)
        text(x0 + (start + n / 2) * tok, y + 17, label, 11, "middle", fill="#fff")
        start += n
    y += 34
    text(pad, y + 15, "skipped (SWA group)", weight="bold")
    out.append(
        f'<rect x="{x0}" y="{y}" width="{ex.skipped * tok:.1f}" height="20" '
        f'fill="url(#hatch)" stroke="{COLORS["skipped"]}"/>'
    )
    text(
        x0 + ex.skipped * tok + 6,
        y + 15,
        f"{ex.skipped} tokens = max(0, {ex.computed} - {ex.sliding_window} + 1)",
        11,
    )
    # computed-before-this-step bracket
    y += 30
    end = x0 + ex.computed * tok
    out.append(f'<path d="M{x0} {y} v6 H{end:.1f} v-6" fill="none" stroke="#5f6368"/>')
    text(
        (x0 + end) / 2,
        y + 18,
        f"computed before this step: {ex.computed} tokens",
        11,
        "middle",
    )
    y += 30
    text(pad, y + 12, "block tables", weight="bold")
    text(x0 + ex.num_blocks * cell + 4, y + 12, "blocks", 10, fill="#5f6368")
    for i in range(ex.num_blocks):
        text(
            x0 + i * cell + cell / 2, y + 12, f"block {i}", 10, "middle", fill="#5f6368"
        )
    y += 18
    for row, kinds in ex.tables().items():
        text(pad, y + 24, row, 11)
        for i, kind in enumerate(kinds):
            x = x0 + i * cell
            if kind == "null":
                out.append(
                    f'<rect x="{x + 2}" y="{y + 4}" width="{cell - 4}" height="30" '
                    'fill="#fff" stroke="#9aa0a6" stroke-dasharray="4 3"/>'
                )
                text(x + cell / 2, y + 24, "null", 11, "middle", fill="#5f6368")
            elif kind == "freed":
                out.append(
                    f'<rect x="{x + 2}" y="{y + 4}" width="{cell - 4}" height="30" '
                    'fill="url(#waste)" stroke="#c5221f" stroke-width="2"/>'
                )
                text(x + cell / 2, y + 24, "freed", 11, "middle", "bold", "#c5221f")
            else:
                out.append(
                    f'<rect x="{x + 2}" y="{y + 4}" width="{cell - 4}" height="30" '
                    f'rx="3" fill="{COLORS[kind]}"/>'
                )
        real = sum(k not in ("null",) for k in kinds)
        text(x0 + ex.num_blocks * cell + 4, y + 24, f"{real}", 11, fill="#5f6368")
        y += 40
    y += 8
    x = pad
    for kind in ("cached", "external", "new", "lookahead"):
        out.append(
            f'<rect x="{x}" y="{y}" width="14" height="14" fill="{COLORS[kind]}"/>'
        )
        text(x + 19, y + 12, LABELS[kind], 11)
        x += 140
    y += 22
    out.append(
        f'<rect x="{pad}" y="{y}" width="14" height="14" fill="#fff" '
        'stroke="#9aa0a6" stroke-dasharray="3 2"/>'
    )
    text(pad + 19, y + 12, "null block (id 0): never allocated or loaded", 11)
    out.append(
        f'<rect x="{pad + 280}" y="{y}" width="14" height="14" fill="url(#waste)" '
        'stroke="#c5221f"/>'
    )
    text(pad + 299, y + 12, "taken from the pool, freed one step later", 11)
    height = y + 24
    defs = (
        "<defs>"
        '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#e8eaed"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{COLORS["skipped"]}" '
        'stroke-width="2"/></pattern>'
        '<pattern id="waste" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fce8e6"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#ee675c" stroke-width="2"/>'
        "</pattern></defs>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 30:.0f}" '
        f'height="{height}" viewBox="0 0 {width + 30:.0f} {height}" '
        'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif" '
        'role="img" aria-label="Token regions and block tables">'
        f"<title>Token regions of one request and its block tables</title>{defs}"
        '<rect width="100%" height="100%" fill="#fff"/>' + "".join(out) + "</svg>\n"
    )
