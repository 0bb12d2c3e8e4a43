"""What an image build takes from the host: its Debian mirrors, its pip folders, the chroot command."""

from __future__ import annotations

import json

from disagg_node_rig import aptsources, archive, chroot, pipaccess
from disagg_node_rig.dockerfile import ImageConfig

DEB822 = """Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main contrib
Enabled: yes
"""


def test_deb822_sources():
    assert aptsources.deb822_entries(DEB822) == [
        "deb http://deb.debian.org/debian bookworm main",
        "deb http://deb.debian.org/debian bookworm-updates main",
        "deb http://deb.debian.org/debian-security bookworm-security main contrib",
    ]


def test_one_line_sources_and_merging():
    listing = "deb [arch=amd64 signed-by=/k.gpg] http://m/debian bookworm main # c\n# deb http://x y z\ndeb-src http://m s c\n"
    assert aptsources.one_line_entries(listing) == ["deb http://m/debian bookworm main"]
    merged = aptsources.entries(
        {"/b.sources": DEB822, "/a.list": "deb http://deb.debian.org/debian bookworm main\n"}
    )
    assert merged[0] == "deb http://deb.debian.org/debian bookworm main" and len(merged) == 3


def test_pip_access_mounts_local_folders_and_an_index_with_its_files():
    listing = (
        "global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
        "global.extra-index-url='file:///opt/pypi/simple https://example.org/simple'\n"
        "global.find-links='/opt/wheels'\n"
        ":env:.find-links='/opt/wheels'\n"
    )
    settings = pipaccess.parse_config_list(listing)
    got = pipaccess.access(settings, {})
    assert got.env == {"PIP_FIND_LINKS": "/opt/wheels",
                       "PIP_EXTRA_INDEX_URL": "file:///opt/pypi/simple https://example.org/simple"}  # fmt: skip
    assert got.mounts == ("/opt/wheels", "/opt/pypi")  # the index's parent: its pages link ../../files
    assert got.local_indexes == ("file:///opt/pypi/simple",)
    overridden = pipaccess.access(settings, {"PIP_FIND_LINKS": "/srv/w /srv/w/sub"})
    assert overridden.env["PIP_FIND_LINKS"] == "/srv/w /srv/w/sub"
    assert "/srv/w/sub" not in overridden.mounts and "/srv/w" in overridden.mounts
    assert pipaccess.access({}, {}).env == {}


def test_chroot_command_isolates_the_step():
    argv = chroot.command("/img/rootfs", ["/bin/sh", "-c", "pip install ."], {"PATH": "/opt/venv/bin", "A": "b c"},
                          "/src", "1000:1000", ["/opt/wheels"])  # fmt: skip
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    script = argv[-1]
    assert "mount -t proc proc /img/rootfs/proc" in script
    assert "mount --rbind /dev /img/rootfs/dev" in script
    assert "mount --bind -o ro /opt/wheels /img/rootfs/opt/wheels" in script
    last = script.splitlines()[-1]
    assert last.startswith(
        "exec chroot --userspec=1000:1000 /img/rootfs /usr/bin/env -i 'A=b c' PATH=/opt/venv/bin"
    )
    assert last.endswith("build /src /bin/sh -c 'pip install .'")


def test_users_of_the_image():
    passwd = "root:x:0:0:root:/root:/bin/bash\ndisagg:x:1000:1000::/home/disagg:/bin/sh\n"
    assert chroot.userspec("", passwd) == (None, "/root")
    assert chroot.userspec("disagg", passwd) == ("1000:1000", "/home/disagg")
    assert chroot.userspec("1000:5", passwd) == ("1000:5", "/home/disagg")
    assert chroot.userspec("4242", passwd) == ("4242:4242", "/")


def test_archive_documents():
    config = ImageConfig(env=(("PATH", "/bin"), ("A", "1")), entrypoint=("disagg",), cmd=None,
                         workdir="/home/disagg", user="1000:1000", exposed=("8000/tcp",))  # fmt: skip
    doc = json.loads(archive.config_document(config, ["sha256:" + "a" * 64]))
    assert doc["config"] == {"Env": ["PATH=/bin", "A=1"], "Entrypoint": ["disagg"], "WorkingDir": "/home/disagg",
                             "User": "1000:1000", "ExposedPorts": {"8000/tcp": {}}}  # fmt: skip
    assert doc["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + "a" * 64]}
    assert (doc["os"], doc["architecture"]) == ("linux", "amd64")
    assert archive.config_document(config, ["sha256:x"]) == archive.config_document(config, ["sha256:x"])
    manifest = json.loads(archive.manifest_document(["docker.io/library/redis:7.4-alpine"]))
    assert manifest == [{"Config": "config.json", "RepoTags": ["docker.io/library/redis:7.4-alpine"],
                         "Layers": ["layer.tar"]}]  # fmt: skip
