"""The RLJob CustomResourceDefinition, generated from the pydantic models (one source of truth).

pydantic writes JSON Schema 2020-12; a CRD wants an OpenAPI v3 *structural* schema. ``structural``
converts: ``$ref`` inlined; ``X | None`` becomes ``X`` with ``nullable: true``; ``const`` becomes
a one-value ``enum``; tuples (``prefixItems``) become arrays with min/max items; free-form objects
(``dict[str, Any]``) keep their keys with ``x-kubernetes-preserve-unknown-fields``; titles,
defaults and ``additionalProperties: false`` are dropped (pydantic applies defaults and rejects
unknown fields when the operator reads the object; the API server would only prune them).

``python -m rljob.crd`` prints the YAML; the chart's copy (``helm/fp8rl/crds/``) is checked
against it by a test, and ``make crd`` rewrites it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from rljob import resource as rl
from rljob.status import JobStatus, Phase

CRD_PATH = Path(__file__).resolve().parents[1] / "helm" / "fp8rl" / "crds" / f"{rl.PLURAL}.{rl.GROUP}.yaml"

_KEEP = {
    "type",
    "description",
    "enum",
    "format",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
}


class SchemaError(ValueError):
    """A model field that has no structural OpenAPI form."""


def structural(schema: dict[str, Any], defs: dict[str, Any], path: str = "") -> dict[str, Any]:
    """One JSON Schema node (pydantic's) as a structural OpenAPI v3 node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs, path)
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(schema["anyOf"])
        if len(options) != 1:
            raise SchemaError(f"{path or '(root)'}: a union of several types has no structural schema")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        out = structural({**options[0], **rest}, defs, path)
        if nullable:
            out["nullable"] = True
        return out
    if "oneOf" in schema:
        return _merged_variants(schema, defs, path)
    out = {k: v for k, v in schema.items() if k in _KEEP}
    if "const" in schema:
        out["enum"] = [schema["const"]]
    if "exclusiveMinimum" in schema:
        out["minimum"], out["exclusiveMinimum"] = schema["exclusiveMinimum"], True
    if "exclusiveMaximum" in schema:
        out["maximum"], out["exclusiveMaximum"] = schema["exclusiveMaximum"], True
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        out["type"] = "object"
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props:
            out["properties"] = {k: structural(v, defs, f"{path}.{k}".lstrip(".")) for k, v in props.items()}
            if schema.get("required"):
                out["required"] = list(schema["required"])
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra, defs, f"{path}.*")
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        if "prefixItems" in schema:
            items = [structural(i, defs, f"{path}[]") for i in schema["prefixItems"]]
            if any(i != items[0] for i in items):
                raise SchemaError(f"{path}: a tuple of mixed types has no structural schema")
            out["items"] = items[0]
            out["minItems"] = out["maxItems"] = len(items)
        else:
            out["items"] = structural(schema.get("items", {}), defs, f"{path}[]")
    elif kind is None:
        raise SchemaError(f"{path or '(root)'}: no type")
    return out


def _merged_variants(schema: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    """A discriminated union of objects (a grader: ``oneOf`` keyed by ``type``) as one object
    schema: every variant's properties, the discriminator's values as one enum, only the
    discriminator required. The API server checks each field's type; which fields go with which
    variant is checked by the spec's models when the operator reads the object."""
    key = schema.get("discriminator", {}).get("propertyName")
    if key is None:
        raise SchemaError(f"{path or '(root)'}: a union without a discriminator has no structural schema")
    variants = [structural(o, defs, path) for o in schema["oneOf"]]
    props: dict[str, Any] = {}
    for variant in variants:
        for name, prop in variant.get("properties", {}).items():
            if name == key:
                enum = props.setdefault(name, {"type": "string", "enum": []})["enum"]
                enum += [v for v in prop.get("enum", []) if v not in enum]
                continue
            seen = props.get(name)
            if seen is None:
                props[name] = prop
            elif seen.get("type") != prop.get("type"):
                raise SchemaError(f"{path}.{name}: variants give it different types")
            elif seen != prop:  # same type, other bounds or words: keep what all share
                props[name] = {k: v for k, v in seen.items() if prop.get(k) == v and k != "description"}
    out: dict[str, Any] = {"type": "object", "properties": props, "required": [key]}
    if "description" in schema:
        out["description"] = schema["description"]
    return out


def _schema(model: type[Any]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    return structural(raw, raw.get("$defs", {}))


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    spec = _schema(rl.RLJobSpec)
    status = _schema(JobStatus)
    status["properties"]["phase"]["enum"] = [p.value for p in Phase]
    columns = [
        ("Phase", "string", ".status.phase", "Where the job is in its lifecycle"),
        ("Step", "integer", ".status.progress.step", "Last completed RL step"),
        ("Reward", "number", ".status.progress.reward", "Mean reward of the last step"),
        ("Tokens/s", "number", ".status.progress.generation_tokens_per_s", "Generation throughput"),
        ("Mismatch", "number", ".status.progress.token_mult_prob_error", "token_mult_prob_error"),
        ("Age", "date", ".metadata.creationTimestamp", ""),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{rl.PLURAL}.{rl.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "fp8rl"},
        },
        "spec": {
            "group": rl.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": rl.KIND,
                "listKind": f"{rl.KIND}List",
                "plural": rl.PLURAL,
                "singular": rl.SINGULAR,
                "shortNames": list(rl.SHORT_NAMES),
                "categories": ["fp8rl"],
            },
            "versions": [
                {
                    "name": rl.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": n, "type": t, "jsonPath": p, **({"description": d} if d else {})}
                        for n, t, p, d in columns
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An end-to-end FP8 RL post-training job.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def missing_fields(served: dict[str, Any], wanted: dict[str, Any] | None = None) -> list[str]:
    """The fields of this version's RLJob schema (``wanted``, default :func:`crd`) that the CRD
    the API server serves lacks, as dotted paths (``status.attempts``). The API server prunes what
    its schema does not know: an operator writing such a field would write it again on every
    reconcile, and a spec field would be dropped from what users apply. Empty: current."""
    wanted = wanted or crd()

    def schema_of(obj: dict[str, Any]) -> dict[str, Any]:
        for version in (obj.get("spec") or {}).get("versions") or []:
            if version.get("name") == rl.VERSION:
                found: dict[str, Any] = (version.get("schema") or {}).get("openAPIV3Schema") or {}
                return found
        return {}

    out: list[str] = []

    def walk(want: dict[str, Any], have: dict[str, Any], path: str) -> None:
        if have.get("x-kubernetes-preserve-unknown-fields"):
            return  # everything below is kept as given
        for key, sub in (want.get("properties") or {}).items():
            here = f"{path}.{key}" if path else key
            if key not in (have.get("properties") or {}):
                out.append(here)
            else:
                walk(sub, have["properties"][key], here)
        if "items" in want and "items" in have:
            walk(want["items"], have["items"], f"{path}[]")

    walk(schema_of(wanted), schema_of(served), "")
    return out


def crd_yaml() -> str:
    header = "# Generated by `python -m rljob.crd` from rljob/ (make crd). Do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def openapi_to_jsonschema(node: Any) -> Any:
    """An OpenAPI v3 (CRD) schema as JSON Schema, to validate objects with ``jsonschema``:
    ``nullable`` becomes a null type, boolean ``exclusiveMinimum`` a number."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(bound) is True:
            out[bound] = out.pop(limit)
        elif out.get(bound) is False:
            out.pop(bound)
    return out


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
