"""Reading policy YAML with limits: a SafeLoader that refuses hostile documents (deep nesting, alias bombs, huge
files) before expanding them, and keeps the file and line of every key for error messages."""
from __future__ import annotations

import re
from typing import Any

import yaml

from .errors import PolicyError
from .policy_check import KeyPath, Loc, format_key_path, show_value


# Every policy text (files, `extends:` parents, presets, `--set` values) is read with these limits: a policy is a few
# KB, and a hostile document (a "billion laughs" of nested aliases, nesting thousands deep, a huge file) is refused
# in milliseconds, before it is expanded, with a PolicyError naming the file and line.
MAX_POLICY_BYTES = 1 << 20
MAX_DEPTH = 64  # nested mappings and lists
MAX_ALIASES = 256  # `*name` uses in one document
MAX_VALUES = 10_000  # values in one document once its aliases and merge keys (`<<: *base`) are expanded
MAX_EXTENDS = 32  # files in one `extends:` chain
_MERGE_TAG = "tag:yaml.org,2002:merge"


class PolicyYamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-5 as a float (YAML 1.1 wants 1.0e-5), and holds the limits above: depth while
    scanning and composing, aliases while composing, the size of merged mappings before they are built (`_walk`
    counts the values)."""

    def __init__(self, text: str, display: str = "<policy>"):
        super().__init__(text)
        self.fxmem_display, self.fxmem_depth, self.fxmem_aliases, self.fxmem_values = display, 0, 0, 0
        self.fxmem_entries: dict[int, int] = {}  # merged size of each mapping node (`fxmem_merged_entries`)
        self.fxmem_top: tuple[str, int] | None = None  # the top-level key being read, and its line

    def fxmem_refuse(self, line: int, what: str) -> PolicyError:
        return PolicyError(f"{self.fxmem_display}:{line}: {what}; policies are read with limits (nesting "
                           f"{MAX_DEPTH}, aliases {MAX_ALIASES}, values {MAX_VALUES}, size {MAX_POLICY_BYTES} bytes)")

    def compose_node(self, parent, index):
        line = self.peek_event().start_mark.line + 1
        if self.check_event(yaml.AliasEvent):
            self.fxmem_aliases += 1
            if self.fxmem_aliases > MAX_ALIASES:
                raise self.fxmem_refuse(line, f"more than {MAX_ALIASES} YAML aliases")
            return super().compose_node(parent, index)
        self.fxmem_depth += 1
        try:
            if self.fxmem_depth > MAX_DEPTH:
                raise self.fxmem_refuse(line, f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.fxmem_depth -= 1

    def fetch_flow_collection_start(self, token_class):
        # the scanner looks ahead up to 1024 characters with a cost per token that grows with the flow nesting
        # (`[[[[...`): refused here, before the composer sees the first of them
        if self.flow_level >= MAX_DEPTH:
            raise self.fxmem_refuse(self.get_mark().line + 1, f"nested more than {MAX_DEPTH} levels deep")
        super().fetch_flow_collection_start(token_class)

    def flatten_mapping(self, node):
        if self.fxmem_merged_entries(node) > MAX_VALUES:
            raise self.fxmem_refuse(node.start_mark.line + 1, f"its merge keys (<<) expand a mapping to more than "
                                                              f"{MAX_VALUES} entries")
        super().flatten_mapping(node)

    def fxmem_merged_entries(self, node) -> int:
        """Entries of the mapping `node` once its merge keys are expanded, counted without building them."""
        known = self.fxmem_entries.get(id(node))
        if known is not None:
            return known
        self.fxmem_entries[id(node)] = 0  # (a mapping merged into itself adds nothing more)
        count = 0
        for key, value in node.value:
            if key.tag != _MERGE_TAG:
                count += 1
                continue
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            count += sum(self.fxmem_merged_entries(m) for m in sources if isinstance(m, yaml.MappingNode))
            if count > MAX_VALUES:
                break
        self.fxmem_entries[id(node)] = count
        return count


PolicyYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def check_size(text: str, display: str) -> None:
    size = len(text.encode("utf-8"))
    if size > MAX_POLICY_BYTES:
        raise PolicyError(f"{display}: {size} bytes; a policy is read only up to {MAX_POLICY_BYTES} bytes (1 MiB)")


def parse_yaml(text: str, display: str) -> tuple[dict, dict[KeyPath, Loc]]:
    check_size(text, display)
    loader = PolicyYamlLoader(text, display)
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            line = f":{mark.line + 1}" if mark else ""
            col = f" (column {mark.column + 1})" if mark else ""
            raise PolicyError(f"{display}{line}: invalid YAML{col}: {yaml_problem(error)}") from None
        except yaml.YAMLError as error:
            raise PolicyError(f"{display}: invalid YAML: {' '.join(str(error).split())}") from None
        if root is None:
            raise PolicyError(f"{display}:1: expected a mapping of policy settings, got an empty file")
        if not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else f"{_node_value_show(loader, root)}"
            raise PolicyError(f"{display}:{root.start_mark.line + 1}: expected a mapping of policy settings "
                              f"(version: 1, passes: ...), got {kind}")
        locs: dict[KeyPath, Loc] = {(): Loc(display, root.start_mark.line + 1, root.start_mark.line + 1)}
        data = _walk(loader, root, (), locs, display, set())
        return data, locs
    finally:
        loader.dispose()


def yaml_problem(error: yaml.MarkedYAMLError) -> str:
    what = error.problem or error.context or "syntax error"
    if error.context and error.problem:
        context_at = f" at line {error.context_mark.line + 1}" if error.context_mark else ""
        what += f" ({error.context}{context_at})"
    return " ".join(what.split())


def _node_value_show(loader, node) -> str:
    try:
        return show_value(loader.construct_object(node, deep=True))
    except yaml.YAMLError:
        return "a scalar"


def _walk(loader, node, path: KeyPath, locs: dict, display: str, active: set) -> Any:
    if id(node) in active:
        raise PolicyError(f"{display}:{node.start_mark.line + 1} {format_key_path(path)}: recursive YAML alias")
    loader.fxmem_values += 1
    if loader.fxmem_values > MAX_VALUES:  # aliases share nodes: this is where a document would grow
        key, line = loader.fxmem_top or (None, node.start_mark.line + 1)
        raise loader.fxmem_refuse(line, f"{'' if key is None else key + ': '}expands to more than {MAX_VALUES} "
                                        "values (nested YAML aliases)")
    if isinstance(node, yaml.MappingNode):
        active = active | {id(node)}
        flattened = loader.__dict__.setdefault("_fxmem_flattened", set())
        seen: dict[str, int] = {}
        for key_node, _ in ([] if id(node) in flattened else node.value):
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise PolicyError(f"{display}:{key_node.start_mark.line + 1} "
                                      f"{format_key_path(path + (key_node.value,))}: "
                                      f"duplicate key (first at line {seen[key_node.value]})")
                seen[key_node.value] = key_node.start_mark.line + 1
        flattened.add(id(node))
        try:
            loader.flatten_mapping(node)  # YAML merge keys (<<: *base)
        except yaml.MarkedYAMLError as error:
            raise PolicyError(f"{display}:{error.problem_mark.line + 1}: invalid YAML: {error.problem}") from None
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                raise PolicyError(f"{display}:{key_node.start_mark.line + 1} {format_key_path(path)}: "
                                  f"expected a string key, got a {kind}")
            key = key_node.value  # keys are names: 'on', 'yes', '1' stay strings
            item_path = path + (key,)
            if not path:
                loader.fxmem_top = (key, key_node.start_mark.line + 1)  # where a document too large to read is said
            out[key] = _walk(loader, value_node, item_path, locs, display, active)
            locs[item_path] = Loc(display, key_node.start_mark.line + 1, value_node.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        active = active | {id(node)}
        items = []
        for index, value_node in enumerate(node.value):
            item_path = path + (index,)
            items.append(_walk(loader, value_node, item_path, locs, display, active))
            locs[item_path] = Loc(display, value_node.start_mark.line + 1, value_node.start_mark.line + 1)
        return items
    try:
        return loader.construct_object(node, deep=True)
    except yaml.MarkedYAMLError as error:
        raise PolicyError(f"{display}:{node.start_mark.line + 1} {format_key_path(path)}: {error.problem}") from None


def parse_value(raw: str, where: str) -> Any:
    """A `--set` value, read as a policy file's values are (same limits; keys stay strings)."""
    check_size(raw, where)
    loader = PolicyYamlLoader(raw, where)
    try:
        node = loader.get_single_node()
        return None if node is None else _walk(loader, node, (), {}, where, set())
    finally:
        loader.dispose()
