"""The Dockerfile interpreter: Docker's reading rules, and the plans of the project's Dockerfiles."""

from __future__ import annotations

from pathlib import Path

import pytest
from disagg_node_rig import build, dockerfile
from disagg_node_rig.dockerfile import Copy, DockerfileError, ImageConfig, MakeDir, Run

ROOT = Path(__file__).resolve().parents[3]
BASES = {"debian:bookworm-slim": ImageConfig(cmd=("bash",))}


def plan(text: str, args: dict[str, str] | None = None) -> dockerfile.Plan:
    return dockerfile.load(text, args or {}, BASES)


def runs(p: dockerfile.Plan) -> list[Run]:
    return [s for s in p.steps if isinstance(s, Run)]


def test_continuations_and_comments_join_into_one_instruction():
    text = "# syntax note\nfrom debian:bookworm-slim\nRUN a \\\n# inside\n\n && b\nrun c\n"
    got = dockerfile.parse(text)
    assert [(i.keyword, i.args, i.line) for i in got] == [
        ("FROM", "debian:bookworm-slim", 2),
        ("RUN", "a && b", 3),
        ("RUN", "c", 7),
    ]


def test_an_unknown_instruction_names_its_line():
    with pytest.raises(DockerfileError, match="line 2: HEALTHCHECK"):
        dockerfile.parse("FROM debian:bookworm-slim\nHEALTHCHECK CMD true\n")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$A", ["a"]),
        ("${A}b", ["ab"]),
        ("${MISSING:-dflt} ${A:-dflt}", ["dflt", "a"]),
        ("${A:+set} ${MISSING:+set}x", ["set", "x"]),
        ("'$A' \"$A b\"", ["$A", "a b"]),
        (r"\$A a\ b", ["$A", "a b"]),
        ("$", ["$"]),
    ],
)
def test_words_substitute_and_unquote(text, expected):
    assert dockerfile.words(text, {"A": "a"}) == expected


def test_env_pairs_see_the_environment_before_their_line():
    p = plan('FROM debian:bookworm-slim\nENV A=1\nENV A=2 B=$A C="x y"\nENV D legacy $B form\n')
    env = p.config.env_dict()
    assert env["A"] == "2" and env["B"] == "1" and env["C"] == "x y" and env["D"] == "legacy 1 form"
    assert env["PATH"] == dockerfile.DEFAULT_PATH


def test_path_extends_the_base_path():
    p = plan("FROM debian:bookworm-slim\nENV PATH=/opt/venv/bin:$PATH\n")
    assert p.config.env_dict()["PATH"] == "/opt/venv/bin:" + dockerfile.DEFAULT_PATH


def test_args_reach_run_steps_but_not_the_image():
    text = "ARG BASE=debian:bookworm-slim\nFROM $BASE\nARG X=default\nARG Y=y\nENV Y=env\nRUN echo\n"
    p = plan(text, {"X": "given", "http_proxy": "http://proxy:3128", "UNUSED": "u"})
    env = dict(runs(p)[0].env)
    assert env["X"] == "given" and env["Y"] == "env"  # ENV wins over ARG
    assert env["http_proxy"] == "http://proxy:3128"  # Docker's predefined proxy arguments
    assert "UNUSED" not in env
    image_env = p.config.env_dict()
    assert "X" not in image_env and "http_proxy" not in image_env


def test_workdir_copy_and_run_folders():
    p = plan("FROM debian:bookworm-slim\nWORKDIR /src\nCOPY a b ./\nCOPY dir ./dir\nWORKDIR sub\nRUN make\n")
    assert p.steps[0] == MakeDir("/src")
    assert p.steps[1] == Copy(("a", "b"), "/src/")
    assert p.steps[2] == Copy(("dir",), "/src/dir")
    assert runs(p)[0].workdir == "/src/sub"
    assert p.config.workdir == "/src/sub"


@pytest.mark.parametrize(
    "line, message",
    [
        ("COPY a b /dest", "needs a directory"),
        ("COPY *.py /dest/", "plain path"),
        ("COPY ../secret /dest/", "plain path"),
        ("COPY --from=builder a /dest/", "--from"),
    ],
)
def test_copy_refuses_what_this_builder_does_not_do(line, message):
    with pytest.raises(DockerfileError, match=message):
        plan(f"FROM debian:bookworm-slim\n{line}\n")


def test_entrypoint_resets_the_base_command_and_forms_are_kept():
    p = plan('FROM debian:bookworm-slim\nENTRYPOINT ["disagg"]\nEXPOSE 8000 53/udp\n')
    assert p.config.entrypoint == ("disagg",) and p.config.cmd is None
    assert p.config.exposed == ("8000/tcp", "53/udp")
    q = plan("FROM debian:bookworm-slim\nCMD redis-server --port 1\nUSER 999:999\n")
    assert q.config.cmd == ("/bin/sh", "-c", "redis-server --port 1") and q.config.user == "999:999"


def test_run_steps_run_as_the_user_of_their_time():
    p = plan("FROM debian:bookworm-slim\nRUN a\nUSER 1000\nRUN b\n")
    assert [r.user for r in runs(p)] == ["", "1000"]


def test_only_known_bases_and_one_stage():
    with pytest.raises(DockerfileError, match="makes only"):
        plan("FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04\n")
    with pytest.raises(DockerfileError, match="one stage"):
        plan("FROM debian:bookworm-slim\nFROM debian:bookworm-slim\n")


# ---- the project's Dockerfiles ----------------------------------------------------------------------


def project_plan(name: str, args: dict[str, str] | None = None) -> dockerfile.Plan:
    bases = {ref: build.BASE_CONFIG for ref in build.SUITES}
    return dockerfile.load((ROOT / "docker" / name).read_text(), args or {}, bases)


def test_worker_cpu_image_takes_torch_from_the_given_index():
    p = project_plan("worker-cpu.Dockerfile", {"TORCH_INDEX": "file:///opt/pypi/simple"})
    torch_step = next(r for r in runs(p) if "torch==" in r.argv[-1])
    assert "--index-url $TORCH_INDEX" in torch_step.argv[-1]
    assert dict(torch_step.env)["TORCH_INDEX"] == "file:///opt/pypi/simple"
    default = project_plan("worker-cpu.Dockerfile")
    assert dict(runs(default)[1].env)["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    env = p.config.env_dict()
    assert "TORCH_INDEX" not in env and "DEBIAN_FRONTEND" not in env
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert (p.config.entrypoint, p.config.user) == (("disagg",), "1000:1000")
    assert p.copy_sources() == (
        "pyproject.toml",
        "setup.py",
        "README.md",
        "src",
    )


def test_operator_image_runs_as_the_charts_user():
    p = project_plan("operator.Dockerfile")
    assert p.base == "debian:bookworm-slim"
    assert p.config.user == "65532:65532"
    assert p.config.entrypoint == ("disagg",)
    assert p.config.cmd == ("operator", "--all-namespaces", "--standalone")


def test_redis_image_serves_the_operators_redis_command():
    from disagg.operator.builders import redis as managed

    p = project_plan("redis.Dockerfile")
    assert p.config.user == f"{managed.USER}:{managed.USER}"
    assert p.config.workdir == "/data"
    assert "redis-server" in runs(p)[0].argv[-1]
