"""Every setting declared once: each command's flags carry their Args class's defaults and show
them in `--help`, `disagg up` and `disagg worker` agree on every flag they share, the planner and
the scheduler run the workers' defaults, command lines written from the classes parse back to the
same values, and each value set is the one the others are checked against."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from disagg.worker import cli
from disagg.worker.cli.flags import Up
from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.settings import env_name, given
from disagg.worker.router.args import RouterArgs, RouterProcessArgs
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.process_args import WorkerProcessArgs

ARGS_CLASSES = (EngineArgs, ServingArgs, RouterArgs, RouterProcessArgs, WorkerProcessArgs)
# the operator's flags are kopf's and its own: no settings class owns them
COMMANDS = [name for name in cli.COMMANDS if name != "operator"]


@pytest.fixture(autouse=True)
def _no_disagg_environment(monkeypatch):
    """Defaults as a bare shell sees them (a pod's DISAGG_* would move them, by design)."""
    for name in list(os.environ):
        if name.startswith("DISAGG_"):
            monkeypatch.delenv(name)


def _parser(command: str) -> argparse.ArgumentParser:
    import importlib

    module = importlib.import_module(cli.COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"disagg {command}", formatter_class=cli.DefaultsHelpFormatter)
    module.add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _settings(parser: argparse.ArgumentParser) -> dict[str, tuple[type, argparse.Action]]:
    """The flags an Args class generated (in its own argument group), with that class."""
    classes = {cls.GROUP: cls for cls in ARGS_CLASSES}
    return {
        a.dest: (classes[g.title], a)
        for g in parser._action_groups
        if g.title in classes
        for a in g._group_actions
    }


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_default_is_its_args_class_default(command):
    parser = _parser(command)
    formatter = parser._get_formatter()
    settings = _settings(parser)
    for dest, (owner, action) in settings.items():
        assert action.default == owner.default(dest), (command, dest)
    for dest, action in _options(parser).items():
        shown = formatter._get_help_string(action).replace("%(default)s", str(action.default))
        unset = action.default in (None, "", []) or (action.nargs == 0 and action.default is False)
        if not unset:
            assert "default" in shown, (
                f"`disagg {command} --help` shows no default for {action.option_strings[0]}"
            )
        if dest in settings and not unset:
            assert f"default: {action.default}" in shown, (command, dest, shown)


def test_up_and_worker_agree_on_every_shared_flag():
    up = {dest: v for dest, v in _settings(_parser("up")).items() if v[0] is not RouterArgs}
    worker = _settings(_parser("worker"))
    assert set(up) <= set(worker)  # every worker setting `up` takes is the worker's own flag
    assert set(ServingArgs.names()) <= set(up)
    for dest in up:
        (_, a), (_, b) = up[dest], worker[dest]
        assert a.option_strings == b.option_strings, dest
        assert a.default == b.default, dest
        assert a.choices == b.choices, dest


def test_up_and_worker_mean_the_same_by_each_shared_flag_name():
    """Flags of the same name outside the settings: the same default, except where `up` means
    another thing (its --port is the router's, its --model defaults to the pretrained model)."""
    up, worker = _options(_parser("up")), _options(_parser("worker"))
    for dest in set(up) & set(worker) - {"port", "model"}:  # up's --model: the pretrained default
        assert up[dest].option_strings == worker[dest].option_strings, dest
        assert up[dest].default == worker[dest].default, dest
        assert up[dest].choices == worker[dest].choices, dest


def test_up_and_router_agree_on_the_router_flags():
    up, router = _options(_parser("up")), _options(_parser("router"))
    for dest in set(RouterArgs.names()) - {"block_size", "max_model_len"}:  # up takes the workers' own
        assert up[dest].default == router[dest].default == RouterArgs.default(dest), dest
        assert up[dest].choices == router[dest].choices, dest
    assert "tool_call_parser" in up


def test_the_planner_simulates_the_workers_defaults():
    import inspect

    from disagg.worker.planner import routing, simulate
    from disagg.worker.planner.advisor import Settings

    s = Settings()
    assert s.max_batch == EngineArgs.max_num_seqs
    assert s.chunk_tokens == EngineArgs.max_num_batched_tokens
    assert s.disagg_threshold == ServingArgs.disagg_threshold
    assert s.prefill_placement == ServingArgs.prefill_placement
    assert s.disagg_busy_slack == ServingArgs.disagg_busy_slack
    served = inspect.signature(routing.simulate).parameters
    assert served["max_batch"].default == EngineArgs.max_num_seqs
    assert served["threshold"].default == ServingArgs.disagg_threshold
    assert served["placement"].default == ServingArgs.prefill_placement
    assert served["busy_slack"].default == ServingArgs.disagg_busy_slack
    for fn in (simulate.disaggregated, simulate.colocated):
        assert inspect.signature(fn).parameters["max_batch"].default == EngineArgs.max_num_seqs
    plan = _options(_parser("plan"))
    assert plan["max_batch"].default == EngineArgs.max_num_seqs
    for dest in ("disagg_threshold", "prefill_placement", "disagg_busy_slack"):
        assert plan[dest].default == ServingArgs.default(dest), dest


def test_the_scheduler_and_the_worker_config_default_as_the_flags_do():
    import inspect

    from disagg.worker.engine.scheduler import Scheduler
    from disagg.worker.serving.main import WorkerConfig

    params = inspect.signature(Scheduler).parameters
    for name in ("max_num_seqs", "max_num_batched_tokens", "mixed_steps"):
        assert params[name].default == EngineArgs.default(name), name
    defaults = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    for name in ("host", "advertise_host", "port", "metrics_port", "redis_url", "deployment"):
        assert defaults[name] == WorkerProcessArgs.default(name), name


def test_process_settings_travel_as_flags_and_back(monkeypatch):
    sent = dict(role="decode", worker_id="d-0", host="0.0.0.0", port=7000, metrics_port=0,
                redis_url="redis://r:6379/0", deployment="default")  # fmt: skip
    flags = WorkerProcessArgs.cli_args(**sent)
    # every value named, defaults included: what a child inherits from DISAGG_* cannot move them
    assert flags[-2:] == [WorkerProcessArgs.cli_flag("deployment"), "default"]
    monkeypatch.setenv("DISAGG_DEPLOYMENT", "elsewhere")
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    _, args = cli.parse(["worker", *flags])
    got = WorkerProcessArgs.from_cli_args(args)
    assert {name: getattr(got, name) for name in sent} == sent
    assert got.advertise_host == "10.0.0.7"  # in a pod, the worker advertises the pod's address
    with pytest.raises(KeyError, match="rank"):
        WorkerProcessArgs.cli_args(rank=1)
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerProcessArgs.cli_args(role="router")
    assert EngineArgs.cli_args(enable_prefix_caching=False) == ["--no-enable-prefix-caching"]


def test_env_names_are_the_flag_without_a_repeated_prefix(monkeypatch):
    assert env_name("disagg_busy_slack") == "DISAGG_BUSY_SLACK"
    assert env_name("disagg_threshold") == "DISAGG_THRESHOLD"
    assert env_name("block_size") == "DISAGG_BLOCK_SIZE"
    monkeypatch.setenv("DISAGG_BUSY_SLACK", "3.5")
    monkeypatch.setenv("DISAGG_PREFILL_PLACEMENT", "threshold")
    _, args = cli.parse(["worker"])
    assert args.disagg_busy_slack == 3.5 and args.prefill_placement == "threshold"
    assert not given(args)  # from the environment, not the command line


def test_a_bad_setting_is_refused_naming_it(monkeypatch):
    with pytest.raises(ValueError, match="disagg_busy_slack must be >= 1"):
        ServingArgs(disagg_busy_slack=0.5)
    with pytest.raises(ValueError, match="prefill_placement must be one of load, threshold"):
        ServingArgs(prefill_placement="nearest")
    with pytest.raises(ValueError, match="max_choices"):
        RouterArgs(max_queue=4, max_choices=8)
    monkeypatch.setenv("DISAGG_THRESHOLD", "many")
    with pytest.raises(SystemExit, match="DISAGG_THRESHOLD"):
        cli.parse(["worker"])


def test_serving_settings_travel_as_flags_and_back():
    sent = ServingArgs(
        kv_transfer="grpc", disagg_threshold=8, prefill_placement="threshold", lease_seconds=5.0
    )
    _, args = cli.parse(["worker", *sent.to_cli_args()])
    assert ServingArgs.from_cli_args(args) == sent
    assert given(args) == {"kv_transfer", "disagg_threshold", "prefill_placement", "lease_seconds"}


def test_up_hands_its_settings_to_the_workers_and_the_router():
    from disagg.worker.cli import up

    _, args = cli.parse(
        [
            "up",
            *ServingArgs.cli_args(disagg_busy_slack=3.0),
            *RouterArgs.cli_args(tool_call_parser="hermes", max_queue=9),
        ]
    )
    serving = up.serving_args(args)
    assert serving == ServingArgs(disagg_busy_slack=3.0)
    assert up.router_args(args).to_cli_args() == RouterArgs.cli_args(max_queue=9, tool_call_parser="hermes")
    # --demo shows the prefill-worker path unless told where to prefill
    _, demo = cli.parse(["up", Up.DEMO])
    assert dataclasses.astuple(up.serving_args(demo))[1:3] == (1, "threshold")
    _, told = cli.parse(["up", Up.DEMO, *ServingArgs.cli_args(prefill_placement="load")])
    assert up.serving_args(told) == ServingArgs()


def test_each_value_set_is_the_one_its_users_check_against():
    from disagg.kernels import kv_quant
    from disagg.operator import spec
    from disagg.worker import kv_transfer
    from disagg.worker.kv_state import records
    from disagg.worker.kv_transfer import layout
    from disagg.worker.model import loader, precisions
    from disagg.worker.router import tool_parsers
    from disagg.worker.router.args import TOOL_CALL_PARSERS
    from disagg.worker.serving import process_args
    from disagg.worker.serving.args import KV_TRANSFERS

    # the kernels sit below the layer that names the KV kinds: their storage table must cover them
    assert kv_quant.KV_CACHE_DTYPES == precisions.KV_CACHE_DTYPES
    assert tuple(loader.DTYPES) == precisions.DTYPES
    assert layout.KV_CACHE_DTYPES == ("auto", *precisions.KV_CACHE_DTYPES)
    assert layout.WEIGHT_QUANTIZATIONS == ("none", *precisions.QUANTIZATIONS)
    # the transports (torch) and the settings (no torch, the operator reads them) name the same
    assert kv_transfer.BACKENDS == KV_TRANSFERS
    assert tuple(tool_parsers.PARSERS) == TOOL_CALL_PARSERS
    assert spec.KV_TRANSFERS is KV_TRANSFERS
    # the operator's settings module cannot import kv_state (its Redis gauge would join the
    # operator's /metrics): the roles a worker takes are the ones the registry admits
    assert process_args.ROLES == records.ROLES
