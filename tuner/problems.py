"""Problem sets: the defaults per op and device, or a YAML/JSON shapes file."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from kernel_space import OpsAdvError, get_op
from ops_adv._table import short


class ShapesFileError(OpsAdvError):
    pass


def default_problems(ops: list[str], device_class: str) -> list[tuple[str, Any]]:
    return [(op, p) for op in ops for p in get_op(op).default_problems(device_class)]


MAX_BYTES = 4 << 20  # a shapes file is a list of problems: 4 MiB is far beyond any real one
MAX_PROBLEMS = 20000
MAX_DEPTH = 32


def _one_line(msg: str, n: int = 300) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def _read(path: str) -> bytes:
    """The file's bytes: a regular file only (not /dev/zero, a FIFO or a folder), at most MAX_BYTES."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ShapesFileError(f"shapes file {_one_line(path, 120)} is not a regular file; pass a YAML or JSON file")
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ShapesFileError(f"cannot read shapes file {_one_line(path, 120)}: {e.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise ShapesFileError(f"shapes file {_one_line(path, 120)} is larger than {MAX_BYTES >> 20} MiB; split it or list fewer problems")
    return raw


MAX_NODES = 200_000


def _load_yaml(text: str):
    """yaml.safe_load with limits: aliases, nesting and the size the aliases expand to (an alias bomb)."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded(root) -> int:
    """Nodes `root` expands to, refusing more than MAX_NODES, deeper than MAX_DEPTH, or a cycle."""
    import yaml

    memo: dict[int, int] = {}

    def visit(node, depth: int, path: set[int]) -> int:
        if depth > MAX_DEPTH:
            raise ShapesFileError(f"is nested deeper than {MAX_DEPTH} levels")
        key = id(node)
        if key in path:
            raise ShapesFileError("has a YAML alias that refers to itself")
        if key in memo:
            return memo[key]
        n = 1
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            path.add(key)
            kids = node.value if isinstance(node, yaml.SequenceNode) else [c for kv in node.value for c in kv]
            for c in kids:
                n += visit(c, depth + 1, path)
                if n > MAX_NODES:
                    raise ShapesFileError(f"expands to more than {MAX_NODES} values (YAML aliases)")
            path.discard(key)
        memo[key] = n
        return n

    return visit(root, 1, set())


def _depth(x, limit: int = MAX_DEPTH) -> bool:
    """Whether `x` nests deeper than `limit` (iterative: no recursion on hostile input)."""
    stack = [(x, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        if isinstance(v, dict):
            stack += [(c, d + 1) for c in v.values()]
        elif isinstance(v, list):
            stack += [(c, d + 1) for c in v]
    return False


def load_shapes(path: str, ops: list[str]) -> list[tuple[str, Any]]:
    """Problems from a file shaped either {op: [problem, ...]} or [{"op": op, ...}, ...].

    Only problems of the requested `ops` are kept, each once; problems of an unknown op are an error.
    """
    name = _one_line(path, 120)
    is_yaml = Path(path).suffix.lower() in (".yaml", ".yml")
    raw = _read(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ShapesFileError(f"shapes file {name} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        if is_yaml:
            import yaml

            data = _load_yaml(text)
        else:
            data = json.loads(text)
    except ShapesFileError as e:
        raise ShapesFileError(f"shapes file {name} is refused: it {e}") from None
    except RecursionError:
        raise ShapesFileError(f"shapes file {name} is nested too deeply") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapesFileError(f"shapes file {name} is not valid {'YAML' if is_yaml else 'JSON'}: {_one_line(first, 160)}") from None
    if not is_yaml and _depth(data):
        raise ShapesFileError(f"shapes file {name} is nested deeper than {MAX_DEPTH} levels")
    entries: list[tuple[Any, Any]] = []
    if isinstance(data, dict):
        for op, items in data.items():
            _spec(op, name)
            if not isinstance(items, list):
                raise ShapesFileError(f"shapes file {name}: {short(op)} must map to a list of problems")
            entries += [(op, item) for item in items]
    elif isinstance(data, list):
        for item in data:
            if not isinstance(item, dict) or "op" not in item:
                raise ShapesFileError(f"shapes file {name}: each entry of a list needs an 'op' field, got {short(item)}")
            item = dict(item)
            entries.append((item.pop("op"), item))
    else:
        raise ShapesFileError(f"shapes file {name} must hold a mapping of op to problems or a list of problems")
    if len(entries) > MAX_PROBLEMS:
        raise ShapesFileError(f"shapes file {name} lists {len(entries)} problems, more than {MAX_PROBLEMS}; split it")
    out: dict[tuple[str, Any], None] = {}  # duplicates merged, first order kept
    for op, item in entries:
        spec = _spec(op, name)
        if not isinstance(item, dict):
            raise ShapesFileError(f"shapes file {name}: a {op} problem must be a mapping, got {short(item)}")
        if not all(isinstance(k, str) for k in item):
            raise ShapesFileError(f"shapes file {name}: a {op} problem's field names must be text, got {short(item)}")
        try:
            problem = spec.parse_problem(item)
        except OpsAdvError as e:
            raise ShapesFileError(f"shapes file {name}: {_one_line(e)}") from None
        except Exception:
            raise ShapesFileError(f"shapes file {name}: invalid {op} problem {short(item)}") from None
        if op in ops:
            out[(op, problem)] = None
    if not out:
        raise ShapesFileError(f"shapes file {name} has no problems for {', '.join(ops)}")
    return list(out)


def _spec(op: Any, name: str):
    if not isinstance(op, str) or len(op) > 64:
        raise ShapesFileError(f"shapes file {name}: unknown op {short(op)}")
    try:
        return get_op(op)
    except OpsAdvError as e:
        raise ShapesFileError(f"shapes file {name}: {_one_line(e)}") from None
