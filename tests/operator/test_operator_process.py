"""`disagg operator` as a process: flags, login from a kubeconfig, liveness, graceful stop.

Cluster-wide here: the emulator cannot list namespaces, which kopf does when scoped to namespaces
(the cluster suite covers that mode)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import kmock
import kopf
import pytest
import yaml
from kube_emulator import RESOURCES, ApiServerEmulator, load_example

from disagg.operator import main
from disagg.operator.kube import Kube
from disagg.worker.cli.ports import free_port


def test_flags_parse():
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(
        ["-n", "a", "--namespace", "b", "--log-format", "json", "--liveness", "http://0.0.0.0:8080/healthz"]
    )
    assert (args.namespace, args.all_namespaces, args.log_format, args.standalone) == (
        ["a", "b"],
        False,
        "json",
        False,
    )
    assert parser.parse_args(["--all-namespaces"]).all_namespaces


def kubeconfig(path, server: str) -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "clusters": [{"name": "emulator", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "tester", "user": {"token": "not-checked"}}],
        "contexts": [
            {"name": "test", "context": {"cluster": "emulator", "user": "tester", "namespace": "default"}}
        ],
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def test_operator_process_reconciles_serves_liveness_and_stops_cleanly(tmp_path):
    async with ApiServerEmulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        live_port = free_port()
        env = dict(os.environ, KUBECONFIG=kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/")))
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "disagg.worker.cli",
                "operator",
                "--all-namespaces",
                "--standalone",
                "--log-format",
                "plain",
                "--liveness",
                f"http://127.0.0.1:{live_port}/healthz",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        api = Kube(kopf.ConnectionInfo(server=str(server.url), insecure=True))
        try:
            await api.apply(load_example("cpu-tiny.yaml"), field_manager="test-user")
            deadline = time.monotonic() + 60
            while await api.get("apps/v1", "StatefulSet", "default", "tiny-decode") is None:
                assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
                assert time.monotonic() < deadline, "the operator process built no children"
                await asyncio.sleep(0.2)
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{live_port}/healthz") as resp,
            ):
                assert resp.status == 200
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            output = proc.stdout.read().decode()
            assert code == 0, output[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            await api.close()


async def test_peering_without_the_peering_crd_is_refused_with_the_reason(tmp_path):
    """kopf would pause every watch waiting for its peering CRD, reconciling nothing, silently."""
    async with ApiServerEmulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        env = dict(os.environ, KUBECONFIG=kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/")))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "disagg.worker.cli", "operator", "--all-namespaces", "--peering", "team",
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 2, output.decode()[-2000:]
        assert "--peering needs kopf's peering CRD (clusterkopfpeerings.kopf.dev)" in output.decode()

        # With the CRD served, the same flags start the operator (it keeps running).
        k8s.resources["kopf.dev/v1/clusterkopfpeerings"] = {
            "kind": "ClusterKopfPeering",
            "namespaced": False,
            "verbs": ["list", "watch", "get", "patch"],
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "disagg.worker.cli", "operator", "--all-namespaces", "--peering", "team",
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(proc.wait(), 8)
        finally:
            proc.terminate()
            await proc.wait()


def test_operator_runs_under_a_uid_with_no_passwd_entry(monkeypatch, as_user):
    """The chart runs the operator as uid 65532, which the image's password database may not
    know: kopf must get its peering identity from us, not from `getpass.getuser()`. A forked
    child drops to that uid and resolves the identity the way kopf does with what `run` passes."""
    import pwd

    from kopf._core.engines import peering

    try:
        pwd.getpwuid(65532)
        pytest.skip("this machine has a passwd entry for uid 65532")
    except KeyError:
        pass
    seen: dict = {}

    async def fake_operator(**kwargs):  # kopf.spawn_tasks' own fallback when no identity is given
        identity = kwargs.get("identity")
        seen["identity"] = identity if identity is not None else peering.detect_own_id(manual=False)

    monkeypatch.setattr(kopf, "operator", fake_operator)
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--all-namespaces", "--standalone", "--log-format", "plain"])
    report = as_user(65532, 65532, lambda: f"{main.run(args)}|{seen['identity']}")
    code, identity = report.split("|", 1)
    assert code == "0", report
    assert identity.startswith("disagg-operator@")
