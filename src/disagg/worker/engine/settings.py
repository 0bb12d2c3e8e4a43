"""What every settings class (`EngineArgs`, `ServingArgs`, `RouterArgs`) shares: a dataclass field
per setting carrying its default, help and check; one command-line flag per field
(`--block-size` for `block_size`), `DISAGG_<FLAG>` as its environment name; the flags that
reproduce a value (`to_cli_args`), which is how one command hands its settings to another, and
those of named values (`cli_args`), how a command line is written from the declarations alone.

Standard library only: the operator imports the settings classes without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import field
from typing import Any

ENV_PREFIX = "DISAGG_"


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, minimum: float | None = None,
            maximum: float | None = None, exclusive_min: bool = False) -> Any:  # fmt: skip
    """A settings field: its default, its help text and the values it accepts."""
    meta = {
        "help": help,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_min": exclusive_min,
    }
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """DISAGG_<FLAG>: `block_size` is DISAGG_BLOCK_SIZE, `disagg_threshold` DISAGG_THRESHOLD
    (the prefix is not repeated)."""
    return ENV_PREFIX + name.upper().removeprefix(ENV_PREFIX)


class Settings:
    """Mixed into a dataclass whose fields are all made with `setting`. `GROUP` titles their
    flags in `--help`; `CLI_EXCLUDED` names fields that `to_cli_args` never writes."""

    GROUP = "settings"
    CLI_EXCLUDED: tuple[str, ...] = ()

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        for f in dataclasses.fields(self):
            check_value(f, getattr(self, f.name))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def cli_flag(cls, name: str) -> str:
        """The command-line flag of a setting; refuses names that are not settings."""
        if name not in cls.names():
            raise KeyError(f"{name!r} is not a setting of {cls.__name__}")
        return flag(name)

    @classmethod
    def default(cls, name: str) -> Any:
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, env: bool = False, skip: tuple[str, ...] = (),
                     defaults: dict[str, Any] | None = None) -> None:  # fmt: skip
        """One flag per setting; with `env`, DISAGG_<FLAG> gives the default (what a pod's
        environment sets). `defaults` replaces a field's default on this command only."""
        group = parser.add_argument_group(cls.GROUP)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            default = shown = (defaults or {}).get(f.name, f.default)
            if env and (raw := os.environ.get(env_name(f.name))) is not None:
                try:
                    default = parse_value(f, raw)
                    check_value(f, default)
                except ValueError as exc:
                    raise SystemExit(f"disagg: {env_name(f.name)}: {exc}") from None
            kwargs: dict[str, Any] = {"default": default, "dest": f.name, "help": help_text(f, shown)}
            if kind(f) is bool:
                kwargs["action"] = _GivenBool
            else:
                kwargs["action"] = _GivenValue
                kwargs["type"] = argparse_type(f)
                if f.metadata.get("choices"):
                    kwargs["choices"] = f.metadata["choices"]
            group.add_argument(flag(f.name), **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides):
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)

    def to_cli_args(self) -> list[str]:
        """Flags for the settings that differ from the defaults."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.CLI_EXCLUDED or value == f.default:
                continue
            out += cli_value(f, value)
        return out

    @classmethod
    def cli_args(cls, **values: Any) -> list[str]:
        """Flags giving exactly these settings, in this order, defaults included: a command line
        whose meaning does not depend on the DISAGG_* variables its process inherits."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        out: list[str] = []
        for name, value in values.items():
            if name not in fields:
                raise KeyError(f"{name!r} is not a setting of {cls.__name__}")
            check_value(fields[name], value)
            out += cli_value(fields[name], value)
        return out


def given(args: argparse.Namespace) -> frozenset[str]:
    """The settings named on the command line (not left at their defaults)."""
    return frozenset(getattr(args, _GIVEN, ()))


_GIVEN = "_settings_given"


def _record(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, _GIVEN, {*getattr(namespace, _GIVEN, ()), dest})


class _GivenValue(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _record(namespace, self.dest)


class _GivenBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


# ---- field helpers ------------------------------------------------------------------------
def cli_value(f: dataclasses.Field, value: Any) -> list[str]:
    """The flag (and its value) that sets `value`."""
    if kind(f) is bool:
        return [flag(f.name) if value else "--no-" + flag(f.name)[2:]]
    return [flag(f.name), str(value)]


def kind(f: dataclasses.Field) -> type:
    """bool, int, float or str, from the annotation (which is a string under postponed evaluation)."""
    base = str(f.type).split("|")[0].strip()
    return {"bool": bool, "int": int, "float": float, "str": str}[base]


def nullable(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)


def parse_value(f: dataclasses.Field, raw: str) -> Any:
    k = kind(f)
    if nullable(f) and raw.strip().lower() in ("", "none"):
        return None
    if k is bool:
        if raw.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if raw.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{f.name}: expected true or false, got {raw!r}")
    try:
        return k(raw)
    except ValueError:
        raise ValueError(f"{f.name}: expected {k.__name__}, got {raw!r}") from None


def argparse_type(f: dataclasses.Field):
    def convert(raw: str):
        try:
            value = parse_value(f, raw)
            check_value(f, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{f.name}: ")) from None
        return value

    convert.__name__ = kind(f).__name__  # argparse names the type in its error message
    return convert


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Raise ValueError naming the setting when `value` is not allowed."""
    if value is None:
        if not nullable(f):
            raise ValueError(f"{f.name} must be set")
        return
    k = kind(f)
    if k is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, k) or (k is int and isinstance(value, bool)):
        raise ValueError(f"{f.name} must be {k.__name__}, got {type(value).__name__} {value!r}")
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        raise ValueError(f"{f.name} must be one of {', '.join(meta['choices'])}; got {value!r}")
    low, high = meta.get("minimum"), meta.get("maximum")
    if low is not None and (value <= low if meta.get("exclusive_min") else value < low):
        op = ">" if meta.get("exclusive_min") else ">="
        raise ValueError(f"{f.name} must be {op} {low:g}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{f.name} must be <= {high:g}, got {value}")


def help_text(f: dataclasses.Field, default: Any = dataclasses.MISSING) -> str:
    """The help of a setting and its default (`default`: the command's own, where it has one)."""
    text = f.metadata.get("help", "")
    default = f.default if default is dataclasses.MISSING else default
    if default not in (None, "") and kind(f) is not bool:  # argparse adds a bool flag's default itself
        text += f" (default: {default})"
    return text
