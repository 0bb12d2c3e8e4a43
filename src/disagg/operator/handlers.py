"""The kopf layer: which events run a reconcile, the finalizer's work, and the operator's settings.

Handlers are registered onto a registry passed in (the default one in production, a fresh one
per test), so several operators can live in one process under test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import kopf

from disagg.operator import constants as c
from disagg.operator import events
from disagg.operator import spec as specs
from disagg.operator.builders import cleanup_job
from disagg.operator.kube import Kube, KubeError
from disagg.operator.reconcile import Reconciler
from disagg.operator.settings import Settings

CHILD_FILTER = {c.LABEL_MANAGED_BY: c.FIELD_MANAGER}
# (group, version, plural) of every kind the builders emit. A kind the cluster does not serve
# (ServiceMonitor without the Prometheus Operator) is simply not watched until it is.
CHILD_RESOURCES = (
    ("apps", "v1", "statefulsets"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("monitoring.coreos.com", "v1", "servicemonitors"),
)


TIMER_EXIT_POLL_SECONDS = 1.0


def default_login(**kwargs) -> kopf.ConnectionInfo:
    """In-cluster service account first, then a kubeconfig (KUBECONFIG or ~/.kube/config)."""
    conn = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if conn is None:
        raise kopf.LoginError("no service account token and no kubeconfig found")
    return conn


def configure_settings(settings: kopf.OperatorSettings) -> None:
    # Our own names for kopf's bookkeeping; status stays ours (and the autoscaler's).
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # A deletion that lands during an autoscaler tick waits for the tick to return; kopf looks
    # again only after this many seconds (60 by default: a minute added to every such deletion).
    settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS


def _owner(body: dict) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of the InferenceDeployment that controls `body`."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if (
            ref.get("controller")
            and ref.get("kind") == c.KIND
            and str(ref.get("apiVersion", "")).startswith(f"{c.GROUP}/")
        ):
            return body["metadata"].get("namespace"), ref["name"], ref.get("uid", "")
    return None


def register(
    registry: kopf.OperatorRegistry,
    *,
    login: Callable[..., kopf.ConnectionInfo] = default_login,
    kube: Kube | None = None,
    resync_seconds: float = Settings.resync_seconds,
    settings: Settings | None = None,
) -> Reconciler:
    """Register every handler of the operator onto `registry`; returns the reconciler it uses."""
    kube = kube or Kube()
    reconciler = Reconciler(kube, settings=settings)
    resource = (c.GROUP, c.VERSION, c.PLURAL)

    @kopf.on.startup(registry=registry, id="disagg-settings")
    def _startup(settings: kopf.OperatorSettings, **_):
        configure_settings(settings)

    @kopf.on.login(registry=registry, id="disagg-login")
    def _login(**kwargs):
        conn = login(**kwargs)
        if login is not default_login:
            # A custom login (an emulated API server): the operator's client uses it too. With the
            # default one, the client reads the same sources itself (refreshing a rotated token).
            kube.configure(conn)
        return conn

    @kopf.on.cleanup(registry=registry, id="disagg-close")
    async def _close(**_):
        await kube.close()

    @kopf.on.resume(*resource, registry=registry, id="reconcile")
    @kopf.on.create(*resource, registry=registry, id="reconcile")
    @kopf.on.update(*resource, registry=registry, id="reconcile")
    async def _reconcile(body, logger, **_):
        outcome = await reconciler.reconcile(dict(body), logger)
        if outcome.applied:
            logger.info("applied %s", ", ".join(outcome.applied))

    @kopf.timer(
        *resource, registry=registry, id="resync", interval=resync_seconds, initial_delay=resync_seconds
    )
    async def _resync(body, logger, **_):
        # Safety net for missed watch events; a no-op when nothing drifted.
        if not body.get("metadata", {}).get("deletionTimestamp"):
            reconciler.recheck_secret(body.get("metadata", {}).get("uid", ""))
            await reconciler.reconcile(dict(body), logger)

    @kopf.on.delete(*resource, registry=registry, id="cleanup")
    async def _delete(body, logger, **_):
        reconciler.forget(body["metadata"].get("uid", ""))
        try:
            idep = specs.parse(dict(body))
        except specs.SpecError as exc:
            logger.warning("spec unreadable at deletion, nothing to clean: %s", exc)
            return
        if idep.spec.redis.managed:
            return  # the managed Redis is garbage-collected with the other children
        # The keys go where the password is mounted: a Job, not this process (see cleanup_job).
        manifest = cleanup_job.job(idep)
        pattern = f"{idep.spec.redis.url}: keys of {idep.deployment_id}"
        try:
            await kube.create_only(manifest)
        except KubeError as exc:
            events.post(
                body,
                type="Warning",
                reason="CleanupSkipped",
                message=f"could not start Job {manifest['metadata']['name']} ({exc}); {pattern} left",
            )
            return
        events.post(
            body,
            type="Normal",
            reason="CleanupScheduled",
            message=f"Job {manifest['metadata']['name']} deletes {pattern}",
        )

    async def _child_changed(event, body, logger, **_):
        obj = dict(body)
        if event.get("type") == "DELETED":
            reconciler.children.deleted(obj)
        else:
            reconciler.children.seen(obj)
        owner = _owner(obj)
        if owner is None:
            return
        namespace, name, uid = owner
        if event.get("type") == "DELETED":
            logger.info("child %s/%s deleted; reconciling %s", obj["kind"], obj["metadata"]["name"], name)
        try:
            # Reads the owner afresh (and skips one that is gone or being deleted).
            await reconciler.reconcile(
                {"metadata": {"namespace": namespace, "name": name, "uid": uid}}, logger
            )
        except (kopf.PermanentError, kopf.TemporaryError) as exc:
            logger.warning("reconcile of %s after a child change did not finish: %s", name, exc)

    # Every kind the operator owns is watched: a child deleted or edited by hand is put back at
    # once, and the reconciler reads children from these events instead of listing them.
    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(group, version, plural, registry=registry, id=f"child-{plural}", labels=CHILD_FILTER)(
            _child_changed
        )
    return reconciler
