"""The host's Debian mirrors, as the one-line `deb URI SUITE COMPONENTS` entries mmdebstrap takes.
Pure: reads the text of `sources.list` files and deb822 `.sources` files."""

from __future__ import annotations


def one_line_entries(text: str) -> list[str]:
    """`deb` lines of a sources.list (options in brackets dropped)."""
    out = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        words = line.split()[1:]
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words.pop(0)
            words.pop(0)
        if len(words) >= 3:
            out.append("deb " + " ".join(words))
    return out


def deb822_entries(text: str) -> list[str]:
    """Each `Types: deb` stanza of a .sources file, one entry per URI and suite."""
    out = []
    for stanza in _stanzas(text):
        if "deb" not in stanza.get("types", "").split() or stanza.get("enabled", "yes") == "no":
            continue
        components = stanza.get("components", "").split()
        for uri in stanza.get("uris", "").split():
            for suite in stanza.get("suites", "").split():
                out.append(" ".join(["deb", uri, suite, *components]))
    return out


def _stanzas(text: str) -> list[dict[str, str]]:
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
            continue
        if raw[0].isspace() and key:
            current[key] += " " + raw.strip()
            continue
        name, _, value = raw.partition(":")
        key = name.strip().lower()
        current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


def entries(files: dict[str, str]) -> list[str]:
    """Entries of every file (name -> text), in name order, without repeats."""
    out: list[str] = []
    for name in sorted(files):
        found = deb822_entries(files[name]) if name.endswith(".sources") else one_line_entries(files[name])
        out.extend(e for e in found if e not in out)
    return out
