"""A Dockerfile, read and evaluated into a build plan: the subset this project's Dockerfiles use
(FROM, ARG, ENV, WORKDIR, COPY, RUN, USER, EXPOSE, ENTRYPOINT, CMD), with Docker's rules for line
continuations, comments, quoting and `$VAR` / `${VAR}` / `${VAR:-word}` / `${VAR:+word}`
substitution. Pure: no file is read and nothing runs here; `build.py` carries the plan out."""

from __future__ import annotations

import dataclasses
import json
import posixpath

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Docker passes these build arguments to RUN without an ARG line, and never into the image.
PROXY_ARGS = frozenset(
    name
    for base in ("http_proxy", "https_proxy", "ftp_proxy", "no_proxy", "all_proxy")
    for name in (base, base.upper())
)
KEYWORDS = ("FROM", "ARG", "ENV", "WORKDIR", "COPY", "RUN", "USER", "EXPOSE", "ENTRYPOINT", "CMD")


class DockerfileError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


# ---- the plan -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """What `config.json` records: the environment, entrypoint, command, working directory, user
    and exposed ports of the image."""

    env: tuple[tuple[str, str], ...] = (("PATH", DEFAULT_PATH),)
    entrypoint: tuple[str, ...] | None = None
    cmd: tuple[str, ...] | None = None
    workdir: str = "/"
    user: str = ""
    exposed: tuple[str, ...] = ()

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclasses.dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str
    user: str


@dataclasses.dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]  # relative to the build context
    dest: str  # absolute; a trailing "/" means a directory
    chown: str | None = None


@dataclasses.dataclass(frozen=True)
class MakeDir:
    path: str  # WORKDIR creates its directory


Step = Run | Copy | MakeDir


@dataclasses.dataclass(frozen=True)
class Plan:
    base: str
    steps: tuple[Step, ...]
    config: ImageConfig

    def copy_sources(self) -> tuple[str, ...]:
        return tuple(src for step in self.steps if isinstance(step, Copy) for src in step.sources)


# ---- reading --------------------------------------------------------------------------------------


def parse(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined and comment lines dropped."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#"):
            continue  # a comment, also inside a continued instruction (parser directives included)
        if not pending and not stripped:
            continue
        if not pending:
            start = number
        if not stripped:
            continue  # an empty line inside a continuation
        body = raw.rstrip()
        if body.endswith("\\"):
            pending.append(body[:-1])
            continue
        pending.append(body)
        out.append(_instruction(" ".join(p.strip() for p in pending), start))
        pending = []
    if pending:
        out.append(_instruction(" ".join(p.strip() for p in pending), start))
    return out


def _instruction(joined: str, line: int) -> Instruction:
    keyword, _, args = joined.partition(" ")
    keyword = keyword.upper()
    if keyword not in KEYWORDS:
        raise DockerfileError(
            f"line {line}: {keyword} is not an instruction this builder knows ({', '.join(KEYWORDS)})"
        )
    return Instruction(keyword, args.strip(), line)


# ---- words and substitution -----------------------------------------------------------------------


def words(text: str, env: dict[str, str]) -> list[str]:
    """Split as Docker's shell lexer does: whitespace between words, single quotes literal, double
    quotes and backslashes escaping, `$` substituted from `env` (unset: empty)."""
    out: list[str] = []
    word: list[str] = []
    in_word = False
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            if in_word:
                out.append("".join(word))
                word, in_word = [], False
            i += 1
            continue
        in_word = True
        if ch == "\\":
            if i + 1 < n:
                word.append(text[i + 1])
            i += 2
        elif ch == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise DockerfileError(f"unmatched ' in: {text}")
            word.append(text[i + 1 : end])
            i = end + 1
        elif ch == '"':
            i += 1
            while i < n and text[i] != '"':
                if text[i] == "\\" and i + 1 < n and text[i + 1] in '"\\$':
                    word.append(text[i + 1])
                    i += 2
                elif text[i] == "$":
                    value, i = _variable(text, i, env)
                    word.append(value)
                else:
                    word.append(text[i])
                    i += 1
            if i >= n:
                raise DockerfileError(f'unmatched " in: {text}')
            i += 1
        elif ch == "$":
            value, i = _variable(text, i, env)
            word.append(value)
        else:
            word.append(ch)
            i += 1
    if in_word:
        out.append("".join(word))
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    """One word's substitution, quotes removed (WORKDIR, USER, a legacy `ENV key value`)."""
    return " ".join(words(text, env))


def _variable(text: str, i: int, env: dict[str, str]) -> tuple[str, int]:
    """The value of the reference at text[i] == "$", and the index after it."""
    n = len(text)
    if i + 1 < n and text[i + 1] == "{":
        end = text.find("}", i + 2)
        if end < 0:
            raise DockerfileError(f"unmatched ${{ in: {text}")
        inner = text[i + 2 : end]
        for op in (":-", ":+"):
            name, found, word = inner.partition(op)
            if found:
                value = env.get(name, "")
                if op == ":-":
                    return (value if value else substitute(word, env)), end + 1
                return (substitute(word, env) if value else ""), end + 1
        return env.get(inner, ""), end + 1
    j = i + 1
    while j < n and (text[j].isalnum() or text[j] == "_"):
        j += 1
    if j == i + 1:
        return "$", j
    return env.get(text[i + 1 : j], ""), j


def _exec_form(args: str) -> list[str] | None:
    if not args.startswith("["):
        return None
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _command(args: str) -> tuple[str, ...]:
    form = _exec_form(args)
    return tuple(form) if form is not None else ("/bin/sh", "-c", args)


# ---- evaluation -----------------------------------------------------------------------------------


def evaluate(instructions: list[Instruction], build_args: dict[str, str],
             bases: dict[str, ImageConfig]) -> Plan:  # fmt: skip
    """The build plan of a one-stage Dockerfile. `bases` maps each image a FROM may name to its
    config; `build_args` are `--build-arg` values (an ARG's default otherwise)."""
    global_args: dict[str, str] = {}
    i = 0
    while i < len(instructions) and instructions[i].keyword == "ARG":
        global_args.update(_arg(instructions[i], build_args, global_args))
        i += 1
    if i == len(instructions) or instructions[i].keyword != "FROM":
        raise DockerfileError("a Dockerfile starts with FROM (after global ARGs)")
    source = instructions[i]
    base_words = words(source.args, global_args)
    if len(base_words) != 1:
        raise DockerfileError(f"line {source.line}: FROM <image> only (no AS, no --platform): {source.args}")
    base = base_words[0]
    if base not in bases:
        raise DockerfileError(
            f"line {source.line}: FROM {base}: this builder makes only {', '.join(sorted(bases))}"
        )
    config = bases[base]
    env = dict(config.env)
    args: dict[str, str] = {k: v for k, v in build_args.items() if k in PROXY_ARGS}
    entrypoint, cmd = config.entrypoint, config.cmd
    workdir, user = config.workdir, config.user
    exposed = list(config.exposed)
    steps: list[Step] = []

    def scope() -> dict[str, str]:
        return {**args, **env}  # ENV wins over ARG of the same name

    for ins in instructions[i + 1 :]:
        k = ins.keyword
        if k == "FROM":
            raise DockerfileError(f"line {ins.line}: one stage only")
        elif k == "ARG":
            args.update(_arg(ins, build_args, scope(), global_args))
        elif k == "ENV":
            for name, value in _env_pairs(ins, scope()):
                env[name] = value
        elif k == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, substitute(ins.args, scope())))
            steps.append(MakeDir(workdir))
        elif k == "COPY":
            steps.append(_copy(ins, scope(), workdir))
        elif k == "RUN":
            run_env = scope()
            steps.append(Run(_command(ins.args), tuple(sorted(run_env.items())), workdir, user))
        elif k == "USER":
            user = substitute(ins.args, scope())
        elif k == "EXPOSE":
            for port in words(ins.args, scope()):
                port = port if "/" in port else f"{port}/tcp"
                if port not in exposed:
                    exposed.append(port)
        elif k == "ENTRYPOINT":
            entrypoint = _command(ins.args)
            cmd = None  # Docker: an ENTRYPOINT resets the base image's CMD
        elif k == "CMD":
            cmd = _command(ins.args)
    image = ImageConfig(tuple(env.items()), entrypoint, cmd, workdir, user, tuple(exposed))
    return Plan(base, tuple(steps), image)


def _arg(ins: Instruction, build_args: dict[str, str], env: dict[str, str],
         global_args: dict[str, str] | None = None) -> dict[str, str]:  # fmt: skip
    out = {}
    for word in _split_raw(ins.args):
        name, has_default, default = word.partition("=")
        if not name.replace("_", "").isalnum():
            raise DockerfileError(f"line {ins.line}: ARG {word}")
        if name in build_args:
            out[name] = build_args[name]
        elif has_default:
            out[name] = substitute(default, env)
        elif global_args and name in global_args:
            out[name] = global_args[name]  # a global ARG redeclared in the stage
    return out


def _split_raw(text: str) -> list[str]:
    """Words with their quotes kept, for ARG/ENV pairs whose values are substituted later."""
    out, word, quote = [], [], None
    for ch in text:
        if quote:
            word.append(ch)
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            word.append(ch)
        elif ch.isspace():
            if word:
                out.append("".join(word))
                word = []
        else:
            word.append(ch)
    if word:
        out.append("".join(word))
    return out


def _env_pairs(ins: Instruction, env: dict[str, str]) -> list[tuple[str, str]]:
    raw = _split_raw(ins.args)
    if not raw:
        raise DockerfileError(f"line {ins.line}: ENV needs a name")
    if "=" not in raw[0]:  # legacy form: ENV NAME the rest is the value
        name, _, value = ins.args.partition(" ")
        return [(name, substitute(value.strip(), env))]
    pairs = []
    for word in raw:
        name, found, value = word.partition("=")
        if not found:
            raise DockerfileError(f"line {ins.line}: ENV {word}: expected NAME=value")
        pairs.append((name, substitute(value, env) if value else ""))  # all from the env before this line
    return pairs


def _copy(ins: Instruction, env: dict[str, str], workdir: str) -> Copy:
    form = _exec_form(ins.args)
    parts = form if form is not None else words(ins.args, env)
    chown = None
    while parts and parts[0].startswith("--"):
        flag, _, value = parts.pop(0).partition("=")
        if flag != "--chown":
            raise DockerfileError(f"line {ins.line}: COPY {flag} is not supported")
        chown = value
    if len(parts) < 2:
        raise DockerfileError(f"line {ins.line}: COPY <src>... <dest>")
    *sources, dest = parts
    for src in sources:
        if any(c in src for c in "*?[") or src.startswith(("/", "..")) or "/../" in f"/{src}/":
            raise DockerfileError(f"line {ins.line}: COPY {src}: a plain path inside the context")
    if len(sources) > 1 and not dest.endswith("/"):
        raise DockerfileError(f"line {ins.line}: COPY of several sources needs a directory ending in /")
    slash = dest.endswith("/") or dest in (".", "./")
    dest = posixpath.normpath(posixpath.join(workdir, dest))
    if slash and not dest.endswith("/"):
        dest += "/"
    return Copy(tuple(posixpath.normpath(s) for s in sources), dest, chown)


def load(text: str, build_args: dict[str, str], bases: dict[str, ImageConfig]) -> Plan:
    return evaluate(parse(text), build_args, bases)
