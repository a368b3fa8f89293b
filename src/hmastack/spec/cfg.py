"""TLC model configurations (``spec/models/*.cfg``): the one reader.

Both the site (constants, invariants, properties and the comment above them)
and the traces (the constants of a simulated model) read a cfg through
:func:`parse_cfg`. A ``\\*`` line before the first section is the config's
comment; ``\\*`` comments elsewhere, whole-line or after a value, are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = ("CONSTANT", "CONSTANTS", "INVARIANT", "INVARIANTS", "PROPERTY",
            "PROPERTIES", "SPECIFICATION", "SYMMETRY", "INIT", "NEXT",
            "CHECK_DEADLOCK", "VIEW", "CONSTRAINT", "CONSTRAINTS")  # fmt: skip


@dataclass
class ModelConfig:
    name: str
    path: Path
    constants: dict[str, str] = field(default_factory=dict)
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
        word = s.split()[0]
        if word in SECTIONS:
            # CONSTANTS -> CONSTANT, PROPERTIES -> PROPERTY, ...
            section = {"PROPERTIES": "PROPERTY"}.get(word, word.removesuffix("S"))
            rest = s[len(word) :].strip()
            if rest:
                _cfg_item(cfg, section, rest)
            continue
        _cfg_item(cfg, section, s)
    cfg.comment = " ".join(c for c in comments if c)
    return cfg


def read_cfg(path: Path) -> ModelConfig:
    return parse_cfg(path.read_text(errors="replace"), path.stem, path)


def _cfg_item(cfg: ModelConfig, section: str | None, s: str) -> None:
    if section == "CONSTANT" and "=" in s:
        key, _, value = s.partition("=")
        cfg.constants[key.strip()] = value.strip()
    elif section == "INVARIANT":
        cfg.invariants += s.split()
    elif section == "PROPERTY":
        cfg.properties += s.split()
