"""RBAC exactly what the code calls: the chart's rules equal the calls the operator process makes.

The calls are recorded by the emulated API server over a whole lifecycle (`rbac_lifecycle`): the
operator's own client and kopf's. Two needs no emulator call shows are added by name, each with
its reason; the real API server (tests/cluster, operator under the chart's ServiceAccount, its log
checked for 403) is the proof that nothing is missing there.
"""

from __future__ import annotations

import pytest
import rbac_lifecycle
from test_operator_chart import by_kind, render

from disagg.operator.autoscaling.handlers import API_ACCESS as AUTOSCALER_ACCESS

# A namespaced kopf lists and watches the namespaces it serves (the emulator cannot serve that
# listing, so the lifecycle runs kopf cluster-wide, which does not make it).
KOPF_NAMESPACED = {("", "namespaces", "list"), ("", "namespaces", "watch")}
# Children carry blockOwnerDeletion owner references; the OwnerReferencesPermissionEnforcement
# admission plugin (where enabled) checks this right on the owner. An admission check, not a call.
OWNER_REFERENCES = {("disagg.dev", "inferencedeployments/finalizers", "update")}
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}


def rules(role: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def granted(values: dict) -> tuple[set, set]:
    """(namespaced grants, cluster-wide grants) of the chart rendered with `values`."""
    docs = by_kind(render(values))
    namespaced = set().union(*(rules(r) for r in docs.get("Role", [])))
    cluster = set().union(*(rules(r) for r in docs.get("ClusterRole", [])))
    return namespaced, cluster


@pytest.fixture(scope="module")
def calls():
    import asyncio

    return asyncio.run(rbac_lifecycle.record())


def test_the_lifecycle_exercised_every_kind_the_operator_writes(calls):
    # The autoscaler's declared needs were all exercised, and no Secret was ever read.
    assert AUTOSCALER_ACCESS <= calls, sorted(AUTOSCALER_ACCESS - calls)
    assert {v for g, r, v in calls if r == "secrets"} == {"create"}
    pruned = {r for g, r, v in calls if v == "delete"}
    assert pruned == {
        "statefulsets",
        "services",
        "networkpolicies",
        "horizontalpodautoscalers",
        "servicemonitors",
        "leaderworkersets",
    }


def test_namespaced_chart_grants_exactly_the_calls(calls):
    namespaced, cluster = granted({})
    assert {(g, r) for g, r, _ in cluster} == CLUSTER_SCOPED
    needed = calls | KOPF_NAMESPACED | OWNER_REFERENCES
    assert namespaced | cluster == needed, (
        f"granted, never called: {sorted((namespaced | cluster) - needed)}; "
        f"called, not granted: {sorted(needed - (namespaced | cluster))}"
    )


def test_cluster_wide_chart_grants_exactly_the_calls(calls):
    namespaced, cluster = granted({"clusterWide": True})
    assert namespaced == set()
    needed = calls | OWNER_REFERENCES
    assert cluster == needed, (
        f"granted, never called: {sorted(cluster - needed)}; called, not granted: {sorted(needed - cluster)}"
    )


def test_no_rule_reads_secrets_or_uses_wildcards():
    for values in ({}, {"clusterWide": True}):
        namespaced, cluster = granted(values)
        for group, resource, verb in namespaced | cluster:
            assert "*" not in (group, resource, verb)
            assert not (resource == "secrets" and verb != "create"), (resource, verb)
