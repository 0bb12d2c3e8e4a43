"""The router's readiness says why it is not ready, from the registry's real failures."""

from __future__ import annotations

import socket

import pytest
import redis

from disagg.worker.cli.ports import free_port
from disagg.worker.router.readiness import REASONS, Readiness, registry_problem


def _redis_error(url: str) -> BaseException:
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except Exception as exc:  # the error a real client raises, which the router sees
        return exc
    finally:
        client.close()
    raise AssertionError(f"{url} answered")


def test_an_unresolvable_redis_host_is_named_as_a_dns_problem():
    assert (
        registry_problem(_redis_error("redis://tiny-redis.demo.svc.invalid:6379"))
        == "registry_name_unresolved"
    )
    assert registry_problem(socket.gaierror(-3, "Temporary failure in name resolution")) == (
        "registry_name_unresolved"
    )


def test_a_refused_redis_port_is_named():
    assert registry_problem(_redis_error(f"redis://127.0.0.1:{free_port()}")) == "registry_refused"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (redis.AuthenticationError("invalid username-password pair"), "registry_auth"),
        (redis.TimeoutError("Timeout connecting to server"), "registry_timeout"),
        (RuntimeError("something else"), "registry_error"),
    ],
)
def test_other_registry_failures(exc, code):
    assert registry_problem(exc) == code


def test_ready_needs_a_decode_worker_and_reports_every_reason():
    state = Readiness(decode=0, prefill=0, registry_problem="registry_name_unresolved", uses_registry=True)
    assert not state.ready and state.reasons == ("registry_name_unresolved", "no_decode_workers")
    body = state.body()
    assert body["status"] == "no_workers" and body["registry"] is False
    assert [r["code"] for r in body["reasons"]] == ["registry_name_unresolved", "no_decode_workers"]
    assert all(r["message"] == REASONS[r["code"]] for r in body["reasons"])
    # a registry outage with workers still known keeps serving, and says so
    state = Readiness(decode=1, prefill=1, registry_problem="registry_refused", uses_registry=True)
    assert state.ready and state.reasons == ("registry_refused",)
    # disaggregated deployment with its prefill pool gone: ready, with the reason
    assert Readiness(1, 0, None, uses_registry=True).reasons == ("no_prefill_workers",)
    assert Readiness(1, 0, None, uses_registry=False).reasons == ()
    assert (
        Readiness(1, 2, None, uses_registry=True).reasons == ()
        and Readiness(1, 2, None, True).body()["registry"]
    )


async def test_the_pool_keeps_why_the_registry_could_not_be_read():
    from disagg.worker.router.workers import WorkerPool

    failure: list[BaseException] = [_redis_error("redis://tiny-redis.demo.svc.invalid:6379")]

    def members():
        if failure:
            raise failure[0]
        return []

    pool = WorkerPool(members_source=members)
    assert pool.registry_problem == "registry_not_read" and pool.uses_registry
    await pool.refresh()
    assert pool.registry_problem == "registry_name_unresolved" and not pool.registry_ok
    failure.clear()
    await pool.refresh()
    assert pool.registry_problem is None and pool.registry_ok
    await pool.stop()
