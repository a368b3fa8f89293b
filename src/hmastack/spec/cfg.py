"""TLC model configurations (``spec/models/*.cfg``): the one reader.

Both the site (constants, invariants, properties and the comment above them)
and the traces (the constants of a simulated model) read a cfg through
:func:`parse_cfg`. A ``\\*`` line before the first section is the config's
comment; ``\\*`` comments elsewhere, whole-line or after a value, are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# TLC's config keywords, the one list: each opens the section named by its
# singular (CONSTANTS -> CONSTANT, PROPERTIES -> PROPERTY).
SECTIONS = {
    word: singular
    for singular, plural in (
        ("CONSTANT", "CONSTANTS"), ("INVARIANT", "INVARIANTS"),
        ("PROPERTY", "PROPERTIES"), ("CONSTRAINT", "CONSTRAINTS"),
        ("ACTION_CONSTRAINT", "ACTION_CONSTRAINTS"), ("SPECIFICATION", None),
        ("SYMMETRY", None), ("INIT", None), ("NEXT", None), ("VIEW", None),
        ("ALIAS", None), ("CHECK_DEADLOCK", None),
    )
    for word in (singular, plural)
    if word
}  # fmt: skip


def section_of(code: str) -> str | None:
    """The section a cfg line (its comment removed) opens, else None."""
    words = code.split(maxsplit=1)
    return SECTIONS.get(words[0]) if words else None


def drop_sections(text: str, sections: set[str]) -> str:
    """A cfg's ``text`` without the ``sections`` (singular names, see
    :data:`SECTIONS`): each from its keyword up to the next section, its
    values on following lines included; blank and comment lines are kept."""
    out, dropping = [], False
    for line in text.splitlines():
        code = line.split("\\*", 1)[0].strip()
        if section := section_of(code):
            dropping = section in sections
        if not dropping or not code:
            out.append(line)
    return "".join(f"{line}\n" for line in out)


@dataclass
class ModelConfig:
    name: str
    path: Path
    constants: dict[str, str] = field(default_factory=dict)
    # ``Definition <- Replacement`` lines of CONSTANTS (a mutation's broken
    # definition, spec/MCHybridKVAlloc.tla)
    overrides: dict[str, str] = field(default_factory=dict)
    invariants: list[str] = field(default_factory=list)
    properties: list[str] = field(default_factory=list)
    comment: str = ""

    @property
    def policy(self) -> str:
        return self.constants.get("Policy", "").strip('"')

    @property
    def mutation(self) -> str:
        return self.constants.get("Mutation", "none").strip('"')


def parse_cfg(text: str, name: str = "", path: Path | None = None) -> ModelConfig:
    """The sections of a cfg's ``text`` (constants as written, unparsed)."""
    cfg = ModelConfig(name, path if path is not None else Path(f"{name}.cfg"))
    section = None
    comments = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("\\*"):
            if section is None:
                comments.append(s[2:].strip())
            continue
        s = s.split("\\*", 1)[0].strip()
        if not s:
            continue
        if opened := section_of(s):
            section = opened
            rest = s[len(s.split()[0]) :].strip()
            if rest:
                _cfg_item(cfg, section, rest)
            continue
        _cfg_item(cfg, section, s)
    cfg.comment = " ".join(c for c in comments if c)
    return cfg


def read_cfg(path: Path) -> ModelConfig:
    return parse_cfg(path.read_text(errors="replace"), path.stem, path)


def _cfg_item(cfg: ModelConfig, section: str | None, s: str) -> None:
    if section == "CONSTANT" and "<-" in s:
        key, _, value = s.partition("<-")
        cfg.overrides[key.strip()] = value.strip()
    elif section == "CONSTANT" and "=" in s:
        key, _, value = s.partition("=")
        cfg.constants[key.strip()] = value.strip()
    elif section == "INVARIANT":
        cfg.invariants += s.split()
    elif section == "PROPERTY":
        cfg.properties += s.split()
