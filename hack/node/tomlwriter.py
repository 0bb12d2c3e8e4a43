"""A dict as TOML (strings, booleans, integers, lists of those, nested tables). Pure."""

from __future__ import annotations

import json
import re

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key)


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def dumps(table: dict, _path: tuple[str, ...] = ()) -> str:
    lines = []
    subtables = []
    for key, value in table.items():
        if isinstance(value, dict):
            subtables.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    out = []
    if _path and (lines or not subtables):
        out.append("[" + ".".join(_key(k) for k in _path) + "]")
    out.extend(lines)
    text = "\n".join(out)
    for key, value in subtables:
        sub = dumps(value, (*_path, key))
        text = f"{text}\n\n{sub}" if text else sub
    return text if _path else text + "\n"
