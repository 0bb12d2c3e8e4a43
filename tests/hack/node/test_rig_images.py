"""The rig's images: the names the product runs them under, and build keys that follow the inputs."""

from __future__ import annotations

from pathlib import Path

import yaml
from disagg_node_rig import images

ROOT = Path(__file__).resolve().parents[3]


def normalized(ref: str) -> str:
    """containerd's name for a short reference (what the kubelet asks it for)."""
    name = ref if "/" in ref else f"library/{ref}"
    first = name.split("/", 1)[0]
    return name if "." in first or ":" in first else f"docker.io/{name}"


def test_worker_image_is_the_examples_image():
    example = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    image = example["spec"]["image"]
    assert images.WORKER_CPU.refs == (f"{image['repository']}:{image['tag']}",)


def test_operator_image_is_the_charts_default():
    values = yaml.safe_load((ROOT / "charts" / "disagg" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "disagg" / "Chart.yaml").read_text())
    tag = values["image"]["tag"] or chart["appVersion"]
    assert images.OPERATOR.refs == (f"{values['image']['repository']}:{tag}",)


def test_redis_image_is_the_operators_default():
    from disagg.operator.spec import Redis

    assert images.REDIS.refs == (normalized(Redis().image),)


def test_every_image_has_its_own_dockerfile_or_none():
    for spec in images.ALL:
        assert spec.dockerfile is None or (ROOT / spec.dockerfile).is_file()
    assert images.by_name("worker-cpu") is images.WORKER_CPU


def test_build_key_follows_content_not_order():
    files = [("a.py", 0o100644, "1" * 64), ("b.py", 0o100644, "2" * 64)]
    key = images.build_key("FROM x", {}, "base", files)
    assert key == images.build_key("FROM x", {}, "base", list(reversed(files)))
    changed = [("a.py", 0o100644, "3" * 64), files[1]]
    assert key != images.build_key("FROM x", {}, "base", changed)
    assert key != images.build_key("FROM x", {}, "base", [("a.py", 0o100755, "1" * 64), files[1]])
    assert key != images.build_key("FROM x\nRUN y", {}, "base", files)
    assert key != images.build_key("FROM x", {}, "other base", files)


def test_step_keys_chain():
    a = images.step_key("base", ("RUN", "x"))
    assert a == images.step_key("base", ("RUN", "x"))
    assert a != images.step_key("other", ("RUN", "x"))
    assert images.step_key(a, ("COPY", "w"), [("w/f", 1, "d")]) != images.step_key(
        a, ("COPY", "w"), [("w/f", 1, "e")]
    )
