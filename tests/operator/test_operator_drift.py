"""What counts as a hand edit of a child: values the operator sets that the live object lacks,
and not the forms in which a real API server stores them."""

from __future__ import annotations

from disagg.operator.drift import differences

DESIRED = {
    "metadata": {"name": "web", "labels": {"a": "1"}},
    "spec": {
        "replicas": 2,
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "worker",
                        "image": "img:1",
                        "args": ["--role", "decode"],
                        "resources": {"requests": {"cpu": 1, "memory": "1Gi"}},
                        "volumeMounts": [{"name": "model", "mountPath": "/models", "readOnly": False}],
                    }
                ],
                "volumes": [{"name": "tmp", "emptyDir": {}}],
            }
        },
    },
}


def live(**changes) -> dict:
    """DESIRED as a real API server returns it: defaults added, zero values left out, quantities as strings."""
    container = {
        "name": "worker",
        "image": changes.get("image", "img:1"),
        "args": changes.get("args", ["--role", "decode"]),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "volumeMounts": [{"name": "model", "mountPath": "/models"}],
        "terminationMessagePath": "/dev/termination-log",
        "imagePullPolicy": "IfNotPresent",
    }
    sidecar = {"name": "mesh-proxy", "image": "proxy:1"}
    return {
        "metadata": {"name": "web", "labels": {"a": "1", "added-by": "someone"}, "resourceVersion": "7"},
        "spec": {
            "replicas": changes.get("replicas", 2),
            "podManagementPolicy": "OrderedReady",
            "template": {
                "spec": {
                    "containers": [sidecar, container],  # merged by name, not position
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                    "restartPolicy": "Always",
                }
            },
        },
        "status": {"replicas": 2},
    }


def test_the_servers_own_additions_and_forms_are_not_drift():
    assert differences(DESIRED, live()) == []


def test_hand_edits_are_named_by_path():
    assert differences(DESIRED, live(image="other:2")) == ["spec.template.spec.containers[worker].image"]
    assert differences(DESIRED, live(replicas=5)) == ["spec.replicas"]
    assert differences(DESIRED, live(args=["--role", "prefill"])) == [
        "spec.template.spec.containers[worker].args[1]"
    ]
    assert differences(DESIRED, live(args=["--role"])) == ["spec.template.spec.containers[worker].args"]
    gone = live()
    del gone["metadata"]["labels"]["a"]
    assert differences(DESIRED, gone) == ["metadata.labels.a"]
    mounted = live()
    mounted["spec"]["template"]["spec"]["containers"][1]["volumeMounts"][0]["readOnly"] = True
    assert differences(DESIRED, mounted) == [
        "spec.template.spec.containers[worker].volumeMounts[model].readOnly"
    ]
