"""`up`, `down` and `status`: the stages in order, each timed, and the teardown that leaves the host
as it was (no mount, cgroup, route, namespace, iptables rule, process or sysctl of the rig)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import (
    aptsources,
    build,
    cgroups,
    cni_config,
    controlplane,
    dockerfile,
    host,
    images,
    kubeconfig,
    mounts,
    network,
    node,
    pipaccess,
    pki,
    proc,
)
from .api import Api
from .layout import Layout
from .settings import SETTINGS, Config

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("containerd", "runc", "ctr", "mmdebstrap", "nsenter", "unshare", "socat", "dnsmasq", "iptables",
         "conntrack", "etcd", "openssl", "ip", "gcc", "tar", "git")  # fmt: skip
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
# every process the rig starts, in the order `down` stops them
PROCESSES = ("dns-sync", "dnsmasq", "kube-proxy", "kubelet", "containerd", "api-relay",
             "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")  # fmt: skip


class RigError(RuntimeError):
    pass


class Clock:
    """Prints each stage with the time it took and the time since the command started."""

    def __init__(self):
        self.t0 = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {message}", flush=True)

    @contextlib.contextmanager
    def stage(self, name: str):
        start = time.monotonic()
        self.say(f"{name} ...")
        yield
        self.say(f"{name}: done in {time.monotonic() - start:.1f}s")


@contextlib.contextmanager
def locked(layout: Layout):
    layout.state.mkdir(parents=True, exist_ok=True)
    with open(layout.lock, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RigError(f"another rig command holds {layout.lock}") from None
        yield


def options(cfg: Config) -> list[str]:
    """The command-line options that give a child process (dns-sync) these very settings."""
    out = []
    for s in SETTINGS:
        out += [f"--{s.name.replace('_', '-')}", str(getattr(cfg, s.name))]
    return out


def admin_api(cfg: Config, layout: Layout, server: str | None = None) -> Api:
    token = (layout.pki / "admin.token").read_text().strip()
    return Api(server or f"https://127.0.0.1:{cfg.api_port}", str(layout.pki / "ca.crt"), token)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise RigError("the rig runs as root (namespaces, mounts, cgroups, chroot builds)")


def _require_tools(cfg: Config, need_k8s: bool = True) -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise RigError(f"missing commands: {' '.join(missing)} (Debian: containerd runc mmdebstrap socat "
                       "dnsmasq-base iptables conntrack etcd-server containernetworking-plugins gcc)")  # fmt: skip
    if need_k8s:
        absent = [b for b in BINARIES if not os.access(cfg.k8s_bin / b, os.X_OK)]
        if absent:
            raise RigError(f"{cfg.k8s_bin} lacks {' '.join(absent)} (Kubernetes v1.36 binaries; set K8S_BIN)")


# ---- images --------------------------------------------------------------------------------------


def build_env(layout: Layout, cfg: Config) -> build.BuildEnv:
    files = {}
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.is_file() and path.suffix in (".list", ".sources"):
            files[str(path)] = path.read_text()
    entries = aptsources.entries(files)
    if not entries:
        raise RigError("no Debian mirror in /etc/apt/sources.list{,.d}: mmdebstrap needs one")
    listing = proc.run([sys.executable, "-m", "pip", "config", "list"], check=False).stdout.decode()
    pip = pipaccess.access(pipaccess.parse_config_list(listing), dict(os.environ))
    args = {k: v for k, v in os.environ.items() if k in dockerfile.PROXY_ARGS}
    torch_index = cfg.torch_index or (pip.local_indexes[0] if pip.local_indexes else "")
    if torch_index:
        args["TORCH_INDEX"] = torch_index
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    return build.BuildEnv(REPO, layout, entries, pip, args, ca if ca.exists() else None)


def build_images(cfg: Config, layout: Layout, clock: Clock, specs=images.ALL) -> dict[str, build.Archive]:
    builder = build.Builder(build_env(layout, cfg), clock.say)
    done: dict[str, build.Archive] = {}
    todo = []
    for spec in specs:
        found = builder.cached(spec)
        if found:
            done[spec.name] = found
            clock.say(f"{spec.name}: cached ({found.path.name})")
        else:
            todo.append(spec)
    if todo:
        suites = {build.SUITES[builder._plan(s)[1].base] for s in todo if s.dockerfile}
        for suite in suites:
            builder.base_tar(suite)
        # two at a time on two cores: the big one's downloads overlap the small ones' work
        with ThreadPoolExecutor(max_workers=2) as pool:
            for spec, built in zip(todo, pool.map(builder.build, todo), strict=True):
                done[spec.name] = built
    return done


def _imported(layout: Layout) -> dict[str, str]:
    try:
        return json.loads(layout.imported.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def import_images(layout: Layout, built: dict[str, build.Archive], clock: Clock) -> None:
    record = _imported(layout)
    present = node.image_refs(layout)
    for name, archive in built.items():
        if record.get(name) == archive.key and set(archive.spec.refs) <= present:
            continue
        t0 = time.monotonic()
        build.import_archive(layout.containerd_socket, archive)
        record[name] = archive.key
        layout.imported.write_text(json.dumps(record, indent=2) + "\n")
        clock.say(f"{name}: imported as {', '.join(archive.spec.refs)} in {time.monotonic() - t0:.0f}s")


# ---- up ------------------------------------------------------------------------------------------


def _running(layout: Layout) -> list[str]:
    return [n for n in PROCESSES if proc.alive(layout, n)]


def _is_up(cfg: Config, layout: Layout) -> bool:
    if _running(layout) != list(PROCESSES) or not network.netns_exists(cfg):
        return False
    try:
        return node.node_ready(admin_api(cfg, layout), cfg.node_name)
    except Exception:  # noqa: BLE001
        return False


def _remnants(cfg: Config, layout: Layout) -> list[str]:
    found = [f"process {n}" for n in _running(layout)]
    if network.netns_exists(cfg):
        found.append(f"netns {cfg.netns}")
    if proc.run(["ip", "link", "show", "dev", cfg.host_veth], check=False).returncode == 0:
        found.append(f"link {cfg.host_veth}")
    found += [f"cgroup {c}" for c in cgroups.leftovers(cfg.cgroup_root)]
    found += [f"mount {m}" for m in mounts.under(mounts.current(), str(cfg.state))]
    if layout.host_record.exists():
        found.append(f"host record {layout.host_record}")
    if layout.run.exists():
        found.append(f"folder {layout.run}")
    return found


def rig_info(cfg: Config, layout: Layout, built: dict[str, build.Archive]) -> dict:
    return {
        "kubeconfig": str(layout.kubeconfig),
        "api_server": f"https://127.0.0.1:{cfg.api_port}",
        "node_name": cfg.node_name,
        "node_ip": cfg.node_ip,
        "host_ip": cfg.host_ip,
        "pod_cidr": cfg.pod_cidr,
        "service_cidr": cfg.service_cidr,
        "kubernetes_service_ip": cfg.kubernetes_service_ip,
        "dns_ip": cfg.dns_ip,
        "cluster_domain": cfg.cluster_domain,
        "netns": cfg.netns,
        "state": str(cfg.state),
        "containerd_socket": str(layout.containerd_socket),
        "images": {name: {"refs": list(a.spec.refs), "key": a.key} for name, a in sorted(built.items())},
        # `<tag_command> SRC DST`: the same image under another name, no rebuild (an image change)
        "tag_command": [
            sys.executable,
            str(REPO / "hack" / "node" / "rig.py"),
            "--state",
            str(cfg.state),
            "tag",
        ],
        "logs": str(layout.logs),
    }


def up(cfg: Config) -> None:
    _require_root()
    _require_tools(cfg)
    layout = Layout(cfg.state)
    clock = Clock()
    with locked(layout):
        with clock.stage("images"):
            built = build_images(cfg, layout, clock)
        if _is_up(cfg, layout):
            clock.say("the rig is already up")
            import_images(layout, built, clock)
            _write_outputs(cfg, layout, built)
            _print_ready(layout, clock)
            return
        left = _remnants(cfg, layout)
        if left:
            clock.say(
                f"a partial rig is left ({', '.join(left[:6])}{' ...' if len(left) > 6 else ''}): tearing it down"
            )
            _down(cfg, layout, clock)
        rec = host.record(layout)
        with clock.stage("network"):
            clash = network.conflicts(cfg)
            if clash:
                raise RigError(
                    f"the host already routes the rig's ranges: {'; '.join(clash)} (change the settings)"
                )
            network.up(cfg)
        with clock.stage("control plane"):
            layout.run.mkdir(parents=True, exist_ok=True)
            wanted = pki.certs(
                cfg.node_name, cfg.node_ip, cfg.host_ip, cfg.kubernetes_service_ip, cfg.cluster_domain
            )
            pki.make(layout.pki, wanted)
            _component_kubeconfigs(cfg, layout)
            api = admin_api(cfg, layout)
            controlplane.start(cfg, layout, api, clock.say)
            node.start_relay(cfg, layout)
            node.publish_api_endpoint(cfg, api)
        with clock.stage("containerd and images"):
            node.start_containerd(cfg, layout, images.PAUSE.refs[0])
            stale = node.remove_containers(layout)
            if stale:  # a rig that died with its pods: containerd restarts without them
                clock.say(f"removed {stale} containers of an earlier rig; restarting containerd")
                proc.stop(layout, "containerd", timeout=20)
                node.start_containerd(cfg, layout, images.PAUSE.refs[0])
            import_images(layout, built, clock)
        with clock.stage("kubelet"):
            node.start_kubelet(cfg, layout)
            restored = node.wait_node_ready(cfg, layout, api, rec["sysctls"])
            clock.say(
                f"Node {cfg.node_name} Ready; sysctls put back: {', '.join(restored) or 'none changed'}"
            )
        with clock.stage("kube-proxy"):
            node.start_proxy(cfg, layout)
            node.wait_service_path(cfg, layout)
        with clock.stage("DNS"):
            node.start_dns(cfg, layout, api, options(cfg))
        _write_outputs(cfg, layout, built)
        _print_ready(layout, clock)


def _component_kubeconfigs(cfg: Config, layout: Layout) -> None:
    ca = (layout.pki / "ca.crt").read_bytes()
    local = f"https://127.0.0.1:{cfg.api_port}"
    via_relay = f"https://{cfg.host_ip}:{cfg.api_port}"  # from inside the namespace
    for component, server, cert in (
        ("kube-controller-manager", local, "kube-controller-manager"),
        ("kube-scheduler", local, "kube-scheduler"),
        ("kubelet", via_relay, "kubelet"),
        ("kube-proxy", via_relay, "kube-proxy"),
    ):
        user = kubeconfig.cert_user(
            (layout.pki / f"{cert}.crt").read_bytes(), (layout.pki / f"{cert}.key").read_bytes()
        )
        path = layout.kubeconfig_of(component)
        path.write_text(kubeconfig.render(server, ca, user))
        path.chmod(0o600)


def _write_outputs(cfg: Config, layout: Layout, built: dict[str, build.Archive]) -> None:
    ca = (layout.pki / "ca.crt").read_bytes()
    token = (layout.pki / "admin.token").read_text().strip()
    layout.kubeconfig.write_text(
        kubeconfig.render(f"https://127.0.0.1:{cfg.api_port}", ca, kubeconfig.token_user(token))
    )
    layout.kubeconfig.chmod(0o600)
    layout.rig_json.write_text(json.dumps(rig_info(cfg, layout, built), indent=2) + "\n")


def _print_ready(layout: Layout, clock: Clock) -> None:
    clock.say(f"ready: {layout.rig_json}")
    print(f"export DISAGG_NODE_KUBECONFIG={layout.kubeconfig}", flush=True)


# ---- down ----------------------------------------------------------------------------------------


def down(cfg: Config) -> None:
    _require_root()
    layout = Layout(cfg.state)
    clock = Clock()
    with locked(layout):
        _down(cfg, layout, clock)
        left = leftovers(cfg, layout)
        if left:
            raise RigError("left behind: " + "; ".join(left))
        clock.say("down: nothing of the rig is left on the host")


def _down(cfg: Config, layout: Layout, clock: Clock) -> None:
    if proc.alive(layout, "kube-apiserver") and proc.alive(layout, "kubelet"):
        with clock.stage("pods"):
            _drain(cfg, layout, clock)
    with clock.stage("node"):
        for name in node.NODE_PROCESSES:
            proc.stop(layout, name)
        if proc.alive(layout, "containerd"):
            n = node.remove_containers(layout)
            if n:
                clock.say(f"removed {n} containers the kubelet left")
        proc.stop(layout, "containerd", timeout=20)
        for pid in node.shim_pids(layout):
            os.kill(pid, 9)
        n = node.remove_runc_leftovers(layout)
        if n:
            clock.say(f"killed {n} containers runc still ran")
        if cgroups.leftovers(cfg.cgroup_root):
            left = cgroups.remove(cfg.cgroup_root)
            if left:
                clock.say(f"cgroups not removed: {', '.join(left[:5])}")
        gone = mounts.unmount_under(str(cfg.state))
        if gone:
            clock.say(f"unmounted {len(gone)} mounts under {cfg.state}")
        cached = node.remove_cni_cache()
        if cached:
            clock.say(f"removed {cached} CNI results of pods that had no teardown")
    with clock.stage("control plane"):
        proc.stop(layout, "api-relay")
        controlplane.stop(layout)
        for name in proc.names(layout):  # anything else a pid file names (an older version's)
            proc.stop(layout, name)
    with clock.stage("network"):
        network.down(cfg)
    rec = host.load(layout)
    if rec is not None:
        changed = host.restore_sysctls(rec["sysctls"])
        if changed:
            clock.say(f"sysctls put back: {', '.join(changed)}")
        network.release_run_netns("/run/netns" in rec.get("missing_dirs", []))
        host.remove_made_dirs(rec)
        layout.host_record.unlink()
    if mounts.under(mounts.current(), str(cfg.state)):
        raise RigError(f"mounts remain under {cfg.state}: not removing {layout.run}")
    if layout.run.exists():
        shutil.rmtree(layout.run)
    for path in (layout.kubeconfig, layout.rig_json):
        path.unlink(missing_ok=True)


def _drain(cfg: Config, layout: Layout, clock: Clock) -> None:
    """Deletes every pod at once (no grace) with the controllers stopped, so the kubelet tears the
    pods down itself: networks released, volumes unmounted, cgroups removed."""
    proc.stop(layout, "kube-scheduler")
    proc.stop(layout, "kube-controller-manager")
    api = admin_api(cfg, layout)
    try:
        for ns in api.items("/api/v1/namespaces"):
            name = ns["metadata"]["name"]
            api.request("DELETE", f"/api/v1/namespaces/{name}/pods?gracePeriodSeconds=0")
    except Exception as exc:  # noqa: BLE001 - teardown goes on without the API
        clock.say(f"pods not deleted through the API: {exc}")
        return
    try:
        proc.wait_for(lambda: not node.containerd_tasks(layout), 60, "the kubelet stopping every container")
    except TimeoutError as exc:
        clock.say(str(exc))


def leftovers(cfg: Config, layout: Layout) -> list[str]:
    found = [f"process {n}" for n in proc.names(layout) if proc.alive(layout, n)]
    found += [f"shim {pid}" for pid in node.shim_pids(layout)]
    found += [f"mount {m}" for m in mounts.under(mounts.current(), str(cfg.state))]
    found += [f"mount {m}" for m in mounts.under(mounts.current(), cfg.netns_path)]
    found += [f"cgroup {c}" for c in cgroups.leftovers(cfg.cgroup_root)]
    if network.netns_exists(cfg):
        found.append(f"netns {cfg.netns}")
    if proc.run(["ip", "link", "show", "dev", cfg.host_veth], check=False).returncode == 0:
        found.append(f"link {cfg.host_veth}")
    if node.CNI_CACHE.is_dir():
        found += [f"CNI result {p}" for p in node.CNI_CACHE.glob(f"{cni_config.NETWORK_NAME}-*")]
    routes = proc.output(["ip", "-4", "route", "show"])
    found += [f"route {line}" for line in routes.splitlines() if cfg.node_ip in line or cfg.host_veth in line]
    return found


# ---- status, tag, test ---------------------------------------------------------------------------


def status(cfg: Config) -> int:
    layout = Layout(cfg.state)
    for name in PROCESSES:
        pid = proc.pid_of(layout, name)
        print(f"{name:<24} {'pid ' + str(pid) if pid else 'not running'}")
    print(f"{'netns ' + cfg.netns:<24} {'present' if network.netns_exists(cfg) else 'absent'}")
    up_now = _is_up(cfg, layout)
    print(f"{'node ' + cfg.node_name:<24} {'Ready' if up_now else 'not ready'}")
    if up_now:
        print(f"export DISAGG_NODE_KUBECONFIG={layout.kubeconfig}")
    return 0 if up_now else 1


def tag(cfg: Config, source: str, target: str) -> None:
    layout = Layout(cfg.state)
    if not proc.alive(layout, "containerd"):
        raise RigError("containerd is not running: make node-up first")
    node.tag(layout, source, target)
    print(f"{target} -> the image of {source}")


def test(cfg: Config, pytest_args: list[str]) -> None:
    layout = Layout(cfg.state)
    if not layout.kubeconfig.exists() or not _is_up(cfg, layout):
        raise RigError("the rig is not up: make node-up first")
    env = dict(os.environ, DISAGG_NODE_KUBECONFIG=str(layout.kubeconfig))
    argv = [sys.executable, "-m", "pytest", "tests/cluster/node", *pytest_args]
    os.chdir(REPO)
    os.execve(sys.executable, argv, env)


def images_only(cfg: Config, names: list[str]) -> None:
    _require_root()
    _require_tools(cfg, need_k8s=False)
    layout = Layout(cfg.state)
    clock = Clock()
    specs = [images.by_name(n) for n in names] if names else list(images.ALL)
    with locked(layout):
        with clock.stage("images"):
            built = build_images(cfg, layout, clock, specs)
        if proc.alive(layout, "containerd"):
            import_images(layout, built, clock)
    for name, archive in built.items():
        print(f"{name}: {archive.path} ({', '.join(archive.spec.refs)})")
