"""`disagg up` as a user runs it: its own secrets (0600 files, never on a command line), a Redis
that refuses clients without the password, and a child that dies is restarted, not the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import redis

from disagg.worker.cli.flags import Up
from disagg.worker.cli.ports import free_port
from disagg.worker.engine.args import EngineArgs
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.process_args import WorkerProcessArgs

pytestmark = pytest.mark.timeout(300)
# prompts of 8+ uncached tokens go to the prefill worker: the tests that check that path
_THRESHOLD_PLACEMENT = ServingArgs.cli_args(prefill_placement="threshold", disagg_threshold=8)


def _children(pid: int) -> list[int]:
    out = []
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        for c in f.read_text().split():
            out += [int(c), *_children(int(c))]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _worker_pid(up: subprocess.Popen, worker_id: str) -> int | None:
    for pid in _children(up.pid):
        if f"{WorkerProcessArgs.cli_flag('worker_id')} {worker_id} " in _cmdline(pid):
            return pid
    return None


def _sees(url: str, token: str) -> set[str]:
    request = urllib.request.Request(f"{url}/internal/workers", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as r:
            return {w["id"] for w in json.load(r)["workers"] if w["ready"]}
    except OSError:
        return set()


@contextlib.contextmanager
def _up(tiny_model: Path, tmp_path: Path, *flags: str):
    """`disagg up` on the tiny model with `flags`, ready to serve: (process, router URL, run dir,
    its log); stopped with SIGTERM after, which must end it cleanly."""
    run_dir, port = tmp_path / "run", free_port()
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "disagg.worker.cli", "up", Up.MODEL, str(tiny_model), Up.PORT, str(port),
           Up.RUN_DIR, str(run_dir), *EngineArgs.cli_args(num_gpu_blocks=256), Up.TIMEOUT, "150", *flags]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while "ready: OpenAI-compatible endpoint" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield up, f"http://127.0.0.1:{port}", run_dir, log
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, log.read_text()[-3000:]


def _assert_prefilled_on(r: httpx.Response, run_dir: Path, worker: str) -> None:
    """`r` was prefilled on `worker`; otherwise fail with the last lines of each child's log."""
    got = r.headers.get("X-Disagg-Prefill-Worker")
    logs = "\n".join(
        f"{f.name}:\n" + "\n".join(f.read_text().splitlines()[-10:]) for f in sorted(run_dir.glob("*.log"))
    )
    assert got == worker, f"prefilled on {got!r}, not {worker!r}\n{logs}"


def test_up_keeps_its_secrets_private_and_restarts_a_dead_child(tiny_model, tmp_path):
    flags = (Up.PREFILL, "1", Up.DECODE, "1", *EngineArgs.cli_args(threads=1))
    with _up(tiny_model, tmp_path, *flags) as running:
        up, url, run_dir, log = running
        secrets_dir = run_dir / "secrets"
        assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
        for name in ("internal-token", "redis-password", "redis.conf"):
            assert stat.S_IMODE((secrets_dir / name).stat().st_mode) == 0o600, name
        token = (secrets_dir / "internal-token").read_text()
        password = (secrets_dir / "redis-password").read_text()
        for pid in [up.pid, *_children(up.pid)]:
            line = _cmdline(pid)
            assert token not in line and password not in line, line
        # its Redis refuses a client without the password
        redis_port = int(next(ln.split()[1] for ln in (secrets_dir / "redis.conf").read_text().splitlines()
                              if ln.startswith("port ")))  # fmt: skip
        client = redis.Redis(port=redis_port)
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        client.close()

        body = {"model": tiny_model.name, "prompt": list(range(5, 60)), "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        # the decode worker dies: up starts it again, as Kubernetes restarts a pod
        old = _worker_pid(up, "decode-0")
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 150

        def wait(done) -> None:
            while not done():
                assert up.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)

        # the router notices the death (until its next poll it still lists the old process as
        # ready; a restart is seconds of loading, many polls), then takes the new process back
        wait(lambda: "decode-0" not in _sees(url, token))
        wait(lambda: _worker_pid(up, "decode-0") not in (None, old) and "decode-0" in _sees(url, token))
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        # the router's log says why a worker left rotation, if one did
        assert r.status_code == 200, r.text + (run_dir / "router.log").read_text(errors="replace")[-3000:]
        assert "decode-0 exited" in log.read_text() and up.poll() is None
        for child_log in run_dir.glob("*.log"):
            text = child_log.read_text(errors="replace")
            assert token not in text and password not in text, child_log


def test_role_ranks_come_from_the_role_flags_else_the_engine_setting():
    from argparse import Namespace

    from disagg.worker.cli.up import role_ranks

    args = Namespace(prefill_tp=2, decode_tp=None, kv_transfer="nixl", prefill=1, decode=1)
    assert role_ranks(args, 1) == {"prefill": 2, "decode": 1, "both": 1}
    assert role_ranks(Namespace(**{**vars(args), "prefill_tp": None}), 2) == {
        "prefill": 2,
        "decode": 2,
        "both": 2,
    }
    with pytest.raises(SystemExit, match="--decode-tp must be >= 1"):
        role_ranks(Namespace(**{**vars(args), "decode_tp": 0}), 1)
    with pytest.raises(SystemExit, match="--prefill-tp 2 needs --kv-transfer nixl"):
        role_ranks(Namespace(**{**vars(args), "kv_transfer": "grpc"}), 1)


def test_each_worker_gets_its_own_kv_disk_directory_and_prefill_no_draft():
    from disagg.worker.cli.up import worker_engine_args
    from disagg.worker.engine.args import EngineArgs

    engine = EngineArgs(kv_host_cache_memory=1 << 20, kv_disk_cache_dir="/var/kv", speculative_method="ngram")
    decode = worker_engine_args(engine, "decode", "decode-1")
    prefill = worker_engine_args(engine, "prefill", "prefill-0")
    assert (decode.kv_disk_cache_dir, prefill.kv_disk_cache_dir) == ("/var/kv/decode-1", "/var/kv/prefill-0")
    assert decode.speculative_method == "ngram" and prefill.speculative_method is None
    assert worker_engine_args(EngineArgs(), "both", "both-0").kv_disk_cache_dir is None


@pytest.mark.slow
def test_up_runs_prefill_and_decode_at_different_tensor_parallel_sizes(tiny_model, tmp_path):
    flags = (Up.PREFILL_TP, "2", Up.DECODE_TP, "1", *_THRESHOLD_PLACEMENT)
    with _up(tiny_model, tmp_path, *flags) as (up, url, run_dir, _):
        # the prefill worker started its second rank, the decode worker none
        assert any(
            "disagg.worker.model.tp_rank" in _cmdline(c) for c in _children(_worker_pid(up, "prefill-0"))
        )
        assert _children(_worker_pid(up, "decode-0")) == []
        body = {"model": tiny_model.name, "prompt": list(range(5, 60)), "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        _assert_prefilled_on(r, run_dir, "prefill-0")


def test_up_gives_each_child_its_own_certificate(tiny_model, tmp_path):
    """`--peer-identity certificate`: a CA for the run, a certificate per child naming it (keys
    0600), mutual TLS between all of them, and the P/D path works with each worker acting only for
    itself."""
    flags = (*EngineArgs.cli_args(threads=1), Up.PEER_IDENTITY, "certificate", *_THRESHOLD_PLACEMENT)
    with _up(tiny_model, tmp_path, *flags) as (_, url, run_dir, _):
        tls = run_dir / "secrets" / "tls"
        assert stat.S_IMODE((tls / "ca.key").stat().st_mode) == 0o600
        for name in ("prefill-0", "decode-0", "router"):
            assert stat.S_IMODE((tls / name).stat().st_mode) == 0o700
            assert stat.S_IMODE((tls / name / "tls.key").stat().st_mode) == 0o600
            subject = subprocess.run(["openssl", "x509", "-noout", "-subject", "-in", str(tls / name / "tls.crt")],
                                     capture_output=True, text=True, check=True).stdout  # fmt: skip
            assert subject.strip().endswith(f"CN = {name}"), subject
        body = {"model": tiny_model.name, "prompt": list(range(5, 60)), "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        # prefilled on prefill-0: a refused Prefill would have been prefilled on decode-0 instead
        _assert_prefilled_on(r, run_dir, "prefill-0")
