"""Problem sets: the defaults per op and device, or a YAML/JSON shapes file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernel_space import OpsAdvError, get_op


class ShapesFileError(OpsAdvError):
    pass


def default_problems(ops: list[str], device_class: str) -> list[tuple[str, Any]]:
    return [(op, p) for op in ops for p in get_op(op).default_problems(device_class)]


def load_shapes(path: str, ops: list[str]) -> list[tuple[str, Any]]:
    """Problems from a file shaped either {op: [problem, ...]} or [{"op": op, ...}, ...].

    Only problems of the requested `ops` are kept; problems of an unknown op are an error.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ShapesFileError(f"cannot read shapes file {path}: {e.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapesFileError(f"shapes file {path} is not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {first}") from None
    entries: list[tuple[str, Any]] = []
    if isinstance(data, dict):
        for op, items in data.items():
            get_op(op)
            if not isinstance(items, list):
                raise ShapesFileError(f"shapes file {path}: '{op}' must map to a list of problems")
            entries += [(op, item) for item in items]
    elif isinstance(data, list):
        for item in data:
            if not isinstance(item, dict) or "op" not in item:
                raise ShapesFileError(f"shapes file {path}: each entry of a list needs an 'op' field, got {item!r}")
            item = dict(item)
            entries.append((item.pop("op"), item))
    else:
        raise ShapesFileError(f"shapes file {path} must hold a mapping of op to problems or a list of problems")
    out = []
    for op, item in entries:
        spec = get_op(op)  # unknown op: a clear error
        if not isinstance(item, dict):
            raise ShapesFileError(f"shapes file {path}: a {op} problem must be a mapping, got {item!r}")
        try:
            problem = spec.parse_problem(item)
        except OpsAdvError as e:
            raise ShapesFileError(f"shapes file {path}: {e}") from None
        if op in ops:
            out.append((op, problem))
    if not out:
        raise ShapesFileError(f"shapes file {path} has no problems for {', '.join(ops)}")
    return out
