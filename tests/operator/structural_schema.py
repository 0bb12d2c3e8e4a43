"""The API server's rules for a CRD's `openAPIV3Schema`, as `apiextensions.k8s.io/v1` enforces them.

Modelled on the apiserver's structural-schema validation (apiextensions-apiserver
`pkg/apiserver/schema/validation.go` and the CRD validation around it): an emulator installs any
CRD, so these are what tells a schema a real cluster would refuse. Each problem is
"<path>: <rule>", the path written as in the apiserver's messages (`properties[spec]...`).
"""

from __future__ import annotations

# Keywords `apiextensions.k8s.io/v1` does not accept at all.
FORBIDDEN = ("$ref", "$schema", "definitions", "dependencies", "id", "patternProperties", "additionalItems")
JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
# What a logical junctor (anyOf, ...) may not carry: only value validations live there.
NOT_IN_JUNCTORS = ("type", "description", "default", "additionalProperties", "nullable", "title")
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
FORMATS = {
    "",
    "bsonobjectid",
    "uri",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "cidr",
    "mac",
    "uuid",
    "uuid3",
    "uuid4",
    "uuid5",
    "isbn",
    "isbn10",
    "isbn13",
    "creditcard",
    "ssn",
    "hexcolor",
    "rgbcolor",
    "byte",
    "password",
    "date",
    "duration",
    "datetime",
    "date-time",
    "int32",
    "int64",
    "float",
    "double",
}
TYPES = ("object", "array", "string", "integer", "number", "boolean")


def problems(schema: dict) -> list[str]:
    """Every rule of a structural schema that `schema` (a version's openAPIV3Schema) breaks."""
    out: list[str] = []
    if schema.get("type") != "object":
        out.append("type: must be object at the root")
    props = schema.get("properties") or {}
    if "metadata" in props:
        out += _metadata(props["metadata"], "properties[metadata]")
    for key in ("apiVersion", "kind"):
        if key in props and props[key].get("type") != "string":
            out.append(f"properties[{key}].type: must be string")
    _node(schema, "", out, root=True)
    return out


def _metadata(node: dict, path: str) -> list[str]:
    # Only name and generateName may be restricted; anything else (a description included) is refused.
    extra = sorted(k for k in node if k not in ("type", "properties"))
    out = [f"{path}: must not specify anything other than name and generateName ({', '.join(extra)})"] * bool(
        extra
    )
    if node.get("type", "object") != "object":
        out.append(f"{path}.type: must be object")
    for name in node.get("properties") or {}:
        if name not in ("name", "generateName"):
            out.append(
                f"{path}.properties[{name}]: must not specify anything other than name and generateName"
            )
    return out


def _node(node: dict, path: str, out: list[str], *, root: bool = False) -> None:
    here = path or "<root>"
    for key in FORBIDDEN:
        if key in node:
            out.append(f"{here}.{key}: is forbidden")
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if preserve is not None and preserve is not True:
        out.append(f"{here}.x-kubernetes-preserve-unknown-fields: must be true or undefined")
    kind = node.get("type")
    if kind is None and not int_or_string and not preserve:
        out.append(f"{here}.type: must not be empty for specified object fields")
    elif kind is not None and kind not in TYPES:
        out.append(f"{here}.type: unsupported value {kind!r}")
    if int_or_string and kind is not None:
        out.append(f"{here}.type: must be empty with x-kubernetes-int-or-string")
    if "properties" in node and "additionalProperties" in node:
        out.append(f"{here}.additionalProperties: must not be used if properties is set")
    if node.get("additionalProperties") is False:
        out.append(f"{here}.additionalProperties: must not be false (unknown fields are pruned)")
    if node.get("uniqueItems") is True:
        out.append(f"{here}.uniqueItems: must not be set to true")
    if "items" in node and not isinstance(node["items"], dict):
        out.append(f"{here}.items: must be a single schema")
    if kind == "array" and not isinstance(node.get("items"), dict):
        out.append(f"{here}.items: must be specified for arrays")
    if node.get("format", "") not in FORMATS:
        out.append(f"{here}.format: unsupported format {node['format']!r}")
    if "default" in node and node["default"] is None and not node.get("nullable"):
        out.append(f"{here}.default: null needs nullable: true")
    if root and "default" in node:
        out.append(f"{here}.default: must not be set at the root")
    for junctor in JUNCTORS:
        if junctor not in node:
            continue
        if int_or_string and junctor == "anyOf" and node[junctor] == INT_OR_STRING:
            continue  # the one allowed shape of int-or-string
        branches = node[junctor] if isinstance(node[junctor], list) else [node[junctor]]
        for i, branch in enumerate(branches):
            for key in NOT_IN_JUNCTORS:
                if key in branch:
                    out.append(f"{here}.{junctor}[{i}].{key}: must not be specified in a logical junctor")
    list_type = node.get("x-kubernetes-list-type")
    if list_type is not None:
        if kind != "array":
            out.append(f"{here}.x-kubernetes-list-type: only for arrays")
        if list_type not in ("atomic", "set", "map"):
            out.append(f"{here}.x-kubernetes-list-type: unsupported value {list_type!r}")
        if list_type == "map":
            keys = node.get("x-kubernetes-list-map-keys") or []
            items = node.get("items") or {}
            if not keys:
                out.append(f"{here}.x-kubernetes-list-map-keys: must be set for a map list")
            for key in keys:
                field = (items.get("properties") or {}).get(key)
                if field is None:
                    out.append(f"{here}.items.properties[{key}]: map keys must be properties of the items")
                elif key not in (items.get("required") or []) and "default" not in field:
                    out.append(f"{here}.items.properties[{key}]: map keys must be required or defaulted")
    for name, child in (node.get("properties") or {}).items():
        if not root or name != "metadata":
            _node(child, f"{path}.properties[{name}]" if path else f"properties[{name}]", out)
    if isinstance(node.get("items"), dict):
        _node(node["items"], f"{here}.items", out)
    if isinstance(node.get("additionalProperties"), dict):
        _node(node["additionalProperties"], f"{here}.additionalProperties", out)
