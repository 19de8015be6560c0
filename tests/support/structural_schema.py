"""A custom resource's structural schema (tests/fixtures/*.schema.json, made by scripts/crd_schema.py) checked as the
API server checks it: JSON Schema, plus Kubernetes' list types, which JSON Schema has no word for. A list of type
"map" holds at most one item for each value of its keys (two env entries named AWS_ACCESS_KEY_ID are refused: "Duplicate
value"), a key left out taking its default first (a port's protocol is TCP); a list of type "set" holds each value once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema

Obj = dict[str, Any]


def duplicates(items: list[Any], keys: list[str] | None, defaults: Obj | None = None) -> Iterator[tuple[int, str]]:
    """(index, what it repeats) of each item whose keys (the whole item, for a set) an earlier item has."""
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        if keys is None:
            identity = item
        elif isinstance(item, dict):
            identity = {key: item.get(key, (defaults or {}).get(key)) for key in keys}
        else:
            continue  # not an object: the item's own schema says so
        text = json.dumps(identity, sort_keys=True)
        if text in seen:
            yield index, f"Duplicate value: {text} (item {seen[text]} has it)"
        else:
            seen[text] = index


def _list_type(validator: Any, list_type: str, instance: Any, schema: Obj) -> Iterator[jsonschema.ValidationError]:
    if not isinstance(instance, list) or list_type not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", []) if list_type == "map" else None
    item_properties = schema.get("items", {}).get("properties", {})
    defaults = {key: item_properties[key]["default"] for key in keys or [] if "default" in item_properties.get(key, {})}
    for index, message in duplicates(instance, keys, defaults):
        yield jsonschema.ValidationError(message, path=(index,))


Validator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-type": _list_type})


def schema_errors(obj: Obj, schema: Obj) -> list[str]:
    """Where ``obj`` breaks ``schema`` (a fixture: its ``source`` is not a keyword): "path: message" each, sorted."""
    validator = Validator({key: value for key, value in schema.items() if key != "source"})
    return sorted(f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
                  for error in validator.iter_errors(obj))


@functools.cache
def fixture_schema(path: Path) -> Obj:
    """A CRD's schema in tests/fixtures (made by scripts/crd_schema.py), read once."""
    return json.loads(path.read_text())


def crd_errors(obj: Obj, path: Path) -> list[str]:
    """Where ``obj`` breaks the CRD whose schema is the fixture at ``path``: a wrong apiVersion alone, else
    ``schema_errors``; [] when the API server takes it."""
    schema = fixture_schema(path)
    if obj.get("apiVersion") != schema["apiVersion"]:
        return [f"apiVersion: {obj.get('apiVersion')!r} is not {schema['apiVersion']!r}"]
    return schema_errors(obj, schema)
