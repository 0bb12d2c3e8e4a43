"""Builds an image without a registry or a container engine: a Debian root filesystem made by
mmdebstrap (cached as a tarball), the Dockerfile's steps carried out on a copy of it (COPY from the
repository's files, RUN in a chroot), then one layer and a docker-archive that `ctr` imports.

The root filesystem is saved before each COPY (keyed by everything up to it), so a code change
starts from the last snapshot instead of from an empty Debian: what a layer cache gives.

During a RUN only, the host's CA bundle stands in for the image's (pip and apt then trust the
host's egress proxy) and the host's local pip folders are mounted read-only; neither stays in the
image."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from . import archive, chroot, dockerfile, images, proc
from .dockerfile import DEFAULT_PATH, Copy, ImageConfig, MakeDir, Run
from .layout import Layout
from .pipaccess import PipAccess

SUITES = {"debian:bookworm-slim": "bookworm", "debian:bookworm": "bookworm"}
BASE_CONFIG = ImageConfig(env=(("PATH", DEFAULT_PATH),), cmd=("bash",))
VARIANT = "minbase"
# What makes Debian's -slim images slim, kept in the image as they are there: no documentation,
# manual pages or translations installed, no package cache left after apt runs.
_APT_CLEAN = '{ "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; }'
BASE_OPTIONS = [
    *(
        f"--dpkgopt=path-exclude=/usr/share/{d}/*"
        for d in ("doc", "man", "groff", "info", "lintian", "linda", "locale")
    ),
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    '--aptopt=Acquire::Languages "none"',
    '--aptopt=Dir::Cache::pkgcache ""',
    '--aptopt=Dir::Cache::srcpkgcache ""',
    f"--aptopt=DPkg::Post-Invoke {_APT_CLEAN}",
    f"--aptopt=APT::Update::Post-Invoke {_APT_CLEAN}",
    # the host's resolver and name were copied in by mmdebstrap; an image carries neither
    '--customize-hook=: > "$1/etc/resolv.conf"',
    '--customize-hook=: > "$1/etc/hostname"',
]
CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
PAUSE_SOURCE = Path(__file__).resolve().parent / "pause.c"


class BuildError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Archive:
    """A built image: a folder with manifest.json, config.json and layer.tar."""

    spec: images.ImageSpec
    key: str
    path: Path


@dataclasses.dataclass
class BuildEnv:
    repo: Path
    layout: Layout
    apt_entries: list[str]
    pip: PipAccess
    build_args: dict[str, str]
    host_ca: Path | None


def repo_files(repo: Path, sources: tuple[str, ...]) -> list[str]:
    """The files under `sources` a build may copy: tracked or new, never ignored ones (the working
    tree as `git status` sees it, so an uncommitted change is built too)."""
    if not sources:
        return []
    out = proc.output(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                       "--", *sources])  # fmt: skip
    files = sorted({f for f in out.split("\0") if f})
    return [f for f in files if os.path.lexists(repo / f)]


def file_entries(repo: Path, files: list[str]) -> list[tuple[str, int, str]]:
    out = []
    for f in files:
        path = repo / f
        st = path.lstat()
        data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        out.append((f, st.st_mode & 0o170777, images.file_digest(data)))
    return out


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Builder:
    def __init__(self, env: BuildEnv, say):
        self.env = env
        self.say = say
        self._base_lock = threading.Lock()
        self.root = env.layout.images

    # ---- keys -----------------------------------------------------------------------------------
    def base_key(self, suite: str) -> str:
        return images.base_key(suite, VARIANT, self.env.apt_entries, BASE_OPTIONS)

    def _plan(self, spec: images.ImageSpec) -> tuple[str, dockerfile.Plan]:
        text = (self.env.repo / spec.dockerfile).read_text()
        bases = {ref: BASE_CONFIG for ref in SUITES}
        try:
            return text, dockerfile.load(text, self.env.build_args, bases)
        except dockerfile.DockerfileError as err:
            raise BuildError(f"{spec.dockerfile}: {err}") from None

    def key(self, spec: images.ImageSpec) -> str:
        if spec.dockerfile is None:
            return images.build_key(PAUSE_SOURCE.read_text(), {}, "", [])
        text, plan = self._plan(spec)
        files = file_entries(self.env.repo, repo_files(self.env.repo, plan.copy_sources()))
        # the evaluated plan holds the build arguments the Dockerfile uses (in its RUN steps)
        return images.build_key(text + "\n" + repr(plan), {}, self.base_key(SUITES[plan.base]), files)

    def archive_dir(self, spec: images.ImageSpec, key: str) -> Path:
        return self.root / "archives" / f"{spec.name}-{key[:20]}"

    def cached(self, spec: images.ImageSpec, key: str | None = None) -> Archive | None:
        key = key or self.key(spec)
        path = self.archive_dir(spec, key)
        return Archive(spec, key, path) if (path / "complete").exists() else None

    # ---- the base root filesystem ---------------------------------------------------------------
    def base_tar(self, suite: str) -> Path:
        key = self.base_key(suite)
        path = self.root / "base" / f"{suite}-{VARIANT}-{key[:20]}.tar"
        with self._base_lock:
            if path.exists():
                return path
            path.parent.mkdir(parents=True, exist_ok=True)
            for old in path.parent.glob(f"{suite}-{VARIANT}-*.tar"):
                old.unlink()
            t0 = time.monotonic()
            self.say(
                f"base: mmdebstrap --variant={VARIANT} {suite} ({len(self.env.apt_entries)} mirror entries)"
            )
            tmp = path.with_suffix(".tmp.tar")
            argv = [
                "mmdebstrap",
                "--quiet",
                f"--variant={VARIANT}",
                *BASE_OPTIONS,
                suite,
                str(tmp),
                *self.env.apt_entries,
            ]
            self._logged(argv, self.env.layout.logs / "build-base.log")
            tmp.rename(path)
            self.say(f"base: {path.stat().st_size >> 20} MiB in {time.monotonic() - t0:.0f}s")
            return path

    # ---- one image ------------------------------------------------------------------------------
    def build(self, spec: images.ImageSpec) -> Archive:
        key = self.key(spec)
        found = self.cached(spec, key)
        if found:
            return found
        t0 = time.monotonic()
        work = self.root / "work" / spec.name
        if work.exists():
            shutil.rmtree(work)
        rootfs = work / "rootfs"
        rootfs.mkdir(parents=True)
        log = self.env.layout.logs / f"build-{spec.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        if spec.dockerfile is None:
            config = self._pause(rootfs, log)
        else:
            config = self._dockerfile(spec, rootfs, log)
        out = self.archive_dir(spec, key)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        self._archive(spec, rootfs, config, out)
        shutil.rmtree(work)
        for old in (self.root / "archives").glob(f"{spec.name}-*"):
            if old != out:
                shutil.rmtree(old)
        size = (out / archive.LAYER_NAME).stat().st_size
        self.say(f"{spec.name}: built in {time.monotonic() - t0:.0f}s ({size >> 20} MiB)")
        return Archive(spec, key, out)

    def _dockerfile(self, spec: images.ImageSpec, rootfs: Path, log: Path) -> ImageConfig:
        _, plan = self._plan(spec)
        suite = SUITES[plan.base]
        files = repo_files(self.env.repo, plan.copy_sources())
        keys = [self.base_key(suite)]
        for step in plan.steps:
            entries = file_entries(self.env.repo, self._copied(step, files)) if isinstance(step, Copy) else []
            keys.append(images.step_key(keys[-1], step, entries))
        # snapshots before the first COPY of each run of them (a later one would save only copying)
        points = [
            i for i, step in enumerate(plan.steps)
            if isinstance(step, Copy) and (i == 0 or not isinstance(plan.steps[i - 1], Copy))
        ]  # fmt: skip
        snapshots = self.root / "steps"
        snapshots.mkdir(parents=True, exist_ok=True)

        def snapshot(i: int) -> Path:
            return snapshots / f"{spec.name}-{keys[i][:20]}.tar"

        start = 0
        for i in reversed(points):
            if snapshot(i).exists():
                start = i
                break
        source = snapshot(start) if start else self.base_tar(suite)
        proc.run(["tar", "-C", str(rootfs), "--numeric-owner", "-xpf", str(source)])
        if start:
            self.say(f"{spec.name}: from the snapshot before step {start + 1}/{len(plan.steps)}")
        for i in range(start, len(plan.steps)):
            step = plan.steps[i]
            if i in points and i != start and not snapshot(i).exists():
                self._tar(rootfs, snapshot(i))
            t0 = time.monotonic()
            self._step(spec, rootfs, step, files, log)
            self.say(
                f"{spec.name}: step {i + 1}/{len(plan.steps)} {_describe(step)} ({time.monotonic() - t0:.0f}s)"
            )
        keep = {snapshot(i) for i in points}
        for old in snapshots.glob(f"{spec.name}-*.tar"):
            if old not in keep:
                old.unlink()
        return plan.config

    @staticmethod
    def _copied(step: Copy, files: list[str]) -> list[str]:
        return [f for f in files if any(f == s or f.startswith(s.rstrip("/") + "/") for s in step.sources)]

    def _step(self, spec, rootfs: Path, step, files: list[str], log: Path) -> None:
        if isinstance(step, MakeDir):
            _inside(rootfs, step.path).mkdir(parents=True, exist_ok=True)
        elif isinstance(step, Copy):
            self._copy(rootfs, step, files)
        elif isinstance(step, Run):
            self._run(spec, rootfs, step, log)

    def _copy(self, rootfs: Path, step: Copy, files: list[str]) -> None:
        owner = (0, 0)
        if step.chown:
            user, _, group = step.chown.partition(":")
            if not user.isdigit() or (group and not group.isdigit()):
                raise BuildError(f"COPY --chown={step.chown}: give numbers")
            owner = (int(user), int(group or user))
        for src in step.sources:
            under = [f for f in files if f == src or f.startswith(src + "/")]
            if not under:
                raise BuildError(f"COPY {src}: no such file in the repository (tracked or new, not ignored)")
            is_dir = under != [src]
            for f in under:
                if is_dir:
                    rel = os.path.relpath(f, src)
                    target = step.dest.rstrip("/") + "/" + rel
                elif step.dest.endswith("/"):
                    target = step.dest + os.path.basename(f)
                else:
                    target = step.dest
                dest = _inside(rootfs, target)
                _make_parents(rootfs, dest.parent)
                if dest.is_symlink() or dest.exists():
                    dest.unlink()
                shutil.copy2(self.env.repo / f, dest, follow_symlinks=False)
                os.chown(dest, *owner, follow_symlinks=False)

    def _run(self, spec, rootfs: Path, step: Run, log: Path) -> None:
        passwd = (rootfs / "etc/passwd").read_text() if (rootfs / "etc/passwd").exists() else ""
        try:
            user, home = chroot.userspec(step.user, passwd)
        except ValueError as err:
            raise BuildError(str(err)) from None
        env = {**self.env.pip.env, "HOME": home, **dict(step.env)}
        _make_dirs(rootfs, step.workdir)  # as BuildKit does when a RUN's folder is gone (rm -rf /src)
        made = []
        for path in self.env.pip.mounts:
            made += _make_dirs(rootfs, path)
        resolv = rootfs / "etc/resolv.conf"
        if not resolv.exists():
            resolv.touch()
        ca_state = self._swap_ca(rootfs)
        argv = chroot.command(str(rootfs), list(step.argv), env, step.workdir, user, self.env.pip.mounts)
        try:
            with open(log, "a") as out:
                out.write(f"\n---- RUN {' '.join(step.argv)}\n")
            self._logged(argv, log, what=f"{spec.name}: RUN {_short(step.argv)}")
        finally:
            self._restore_ca(rootfs, ca_state)
            for d in reversed(made):
                try:
                    d.rmdir()
                except OSError:
                    pass

    # ---- the CA bundle, for the length of one RUN -----------------------------------------------
    def _swap_ca(self, rootfs: Path):
        if self.env.host_ca is None:
            return None
        target = rootfs / CA_BUNDLE
        if target.is_symlink():
            return None
        original = target.read_bytes() if target.exists() else None
        made = _make_dirs(rootfs, "/" + os.path.dirname(CA_BUNDLE))
        host = self.env.host_ca.read_bytes()
        target.write_bytes(host)
        return original, made, host

    def _restore_ca(self, rootfs: Path, state) -> None:
        if state is None:
            return
        original, made, host = state
        target = rootfs / CA_BUNDLE
        if not target.exists() or target.read_bytes() != host:
            return  # the step made its own bundle (installed ca-certificates): keep it
        if original is None:
            target.unlink()
            for d in reversed(made):
                try:
                    d.rmdir()
                except OSError:
                    pass
        else:
            target.write_bytes(original)

    # ---- the pause image ------------------------------------------------------------------------
    def _pause(self, rootfs: Path, log: Path) -> ImageConfig:
        binary = rootfs / "pause"
        self._logged(["gcc", "-Os", "-static", "-DVERSION=3.10", "-o", str(binary), str(PAUSE_SOURCE)], log)
        self._logged(["strip", str(binary)], log)
        return ImageConfig(env=(("PATH", DEFAULT_PATH),), entrypoint=("/pause",), user="65535:65535")

    # ---- layer and archive ----------------------------------------------------------------------
    @staticmethod
    def _tar(rootfs: Path, out: Path) -> None:
        tmp = out.with_suffix(".tmp")
        proc.run(["tar", "-C", str(rootfs), "--numeric-owner", "--sort=name",
                  "--exclude=./dev/*", "--exclude=./proc/*", "-cf", str(tmp), "."])  # fmt: skip
        tmp.rename(out)

    def _archive(self, spec: images.ImageSpec, rootfs: Path, config: ImageConfig, out: Path) -> None:
        layer = out / archive.LAYER_NAME
        self._tar(rootfs, layer)
        diff_id = "sha256:" + _sha256_file(layer)
        (out / archive.CONFIG_NAME).write_bytes(archive.config_document(config, [diff_id]))
        (out / archive.MANIFEST_NAME).write_bytes(archive.manifest_document(list(spec.refs)))
        (out / "complete").write_text(json.dumps({"refs": spec.refs, "diff_id": diff_id}) + "\n")

    def _logged(self, argv: list[str], log: Path, what: str | None = None) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = log.read_text(errors="replace").splitlines()[-25:]
            raise BuildError(
                f"{what or argv[0]}: exit {done.returncode}; last lines of {log}:\n" + "\n".join(tail)
            )


def import_archive(socket: Path, built: Archive) -> None:
    """`ctr images import` of the archive, streamed (no second copy of the layer on disk)."""
    names = [archive.MANIFEST_NAME, archive.CONFIG_NAME, archive.LAYER_NAME]
    with subprocess.Popen(["tar", "-C", str(built.path), "-cf", "-", *names], stdout=subprocess.PIPE) as tar:
        done = subprocess.run(
            ["ctr", "-a", str(socket), "-n", "k8s.io", "images", "import", "-"],
            stdin=tar.stdout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        tar.stdout.close()
    if done.returncode != 0 or tar.returncode != 0:
        raise BuildError(
            f"import of {built.spec.name}: {done.stdout.decode(errors='replace').strip()[-2000:]}"
        )


def _inside(rootfs: Path, path: str) -> Path:
    """`path` of the image, refusing any that resolves outside the root filesystem (a symlink)."""
    target = rootfs / path.lstrip("/")
    real_root = os.path.realpath(rootfs)
    parent = os.path.realpath(target.parent)
    if parent != real_root and not parent.startswith(real_root + os.sep):
        raise BuildError(f"{path} resolves outside the image ({parent})")
    return target


def _make_parents(rootfs: Path, path: Path) -> None:
    if not path.exists():
        _make_dirs(rootfs, "/" + str(path.relative_to(rootfs)))


def _make_dirs(rootfs: Path, path: str) -> list[Path]:
    """mkdir -p inside the image (root-owned, 0755); returns the folders it made, outermost first."""
    made = []
    current = rootfs
    for part in Path(path.lstrip("/")).parts:
        current = current / part
        if not current.exists():
            current.mkdir(mode=0o755)
            made.append(current)
    return made


def _short(argv: tuple[str, ...]) -> str:
    text = argv[-1] if argv[:2] == ("/bin/sh", "-c") else " ".join(argv)
    text = " ".join(text.split())
    return text if len(text) <= 70 else text[:67] + "..."


def _describe(step) -> str:
    if isinstance(step, Run):
        return f"RUN {_short(step.argv)}"
    if isinstance(step, Copy):
        return f"COPY {' '.join(step.sources)} {step.dest}"
    return f"WORKDIR {step.path}"
