"""The house stays walkable: small test files (one over 500 lines has grown a second concern: split
it by what it does; source files are split by concern, not by a count), no import loop between the package's folders and
the modules at its root, nor between two of its files, and a map (docs/architecture.md, "Find it in 30 seconds") whose
files and functions exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def too_long(folder: Path, limit: int) -> list[str]:
    lengths = {p: len(p.read_text().splitlines()) for p in folder.rglob("*.py")}
    return sorted(f"{p.relative_to(ROOT)}: {n} lines" for p, n in lengths.items() if n > limit)


def test_no_test_file_is_over_500_lines():
    assert too_long(ROOT / "tests", 500) == []


PACKAGE = ROOT / "src" / "commsched"


def node_of(dotted: str) -> str | None:
    """The node a module of the package belongs to: its folder below `commsched/`, or the root module
    itself (``commsched.say`` -> ``say``); ``__init__`` is the package's own facade."""
    parts = dotted.split(".")
    if parts[0] != "commsched":
        return None
    if len(parts) == 1:
        return "__init__"
    if (PACKAGE / parts[1] / "__init__.py").is_file() or (PACKAGE / f"{parts[1]}.py").is_file():
        return parts[1]
    return None


def package_imports() -> dict[str, dict[str, set[str]]]:
    """For each node (a folder of the package, or a module at its root), the other nodes its files
    import, each with the files that do (lazy imports included)."""
    edges: dict[str, dict[str, set[str]]] = {}
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for source in PACKAGE.rglob("*.py"):
        relative = source.relative_to(PACKAGE)
        here = "__init__" if relative == Path("__init__.py") else relative.parts[0].removesuffix(".py")
        edges.setdefault(here, {})
        for name in modules_imported(source, modules):
            there = node_of(name)  # `from commsched import CommSchedConfigError`: the facade, "__init__"
            if there is not None and there != here:
                edges[here].setdefault(there, set()).add(str(source.relative_to(ROOT)))
    return edges


def loops(edges: dict[str, dict[str, set[str]]]) -> list[str]:
    """One loop through each group of nodes that reach each other (Tarjan's strongly connected
    components), spelt with the files behind each step."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges.get(node, {}):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(edges):
        if node not in index:
            connect(node)
    found = []
    for group in groups:
        start = min(group)
        path, seen = [start], {start}
        while True:  # walk inside the group until a node repeats: that is a loop
            nxt = min(n for n in edges[path[-1]] if n in group)
            if nxt in seen:
                path = path[path.index(nxt) :] + [nxt]
                break
            path.append(nxt)
            seen.add(nxt)
        found.append(
            " -> ".join(f"{a} ({', '.join(sorted(edges[a][b]))})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"
        )
    return found


def test_no_loop_between_the_package_folders():
    """No folder of the package, and no module at its root, imports one that imports it back: each
    root module is a node of its own beside the folders (the root holds the shared basics, below
    everyone), and a loop through several of them fails as one between two."""
    edges = package_imports()
    assert {"runtime", "comm", "cli", "schedules", "say", "errors"} <= set(edges), sorted(edges)
    assert loops(edges) == []


def module_name(source: Path) -> str:
    """``src/commsched/cli/config.py`` -> ``commsched.cli.config``; a package's ``__init__`` is the package."""
    parts = list(source.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_imported(source: Path, modules: set[str]) -> set[str]:
    """The package's modules a file imports, at the top or inside functions: ``from commsched.sim import
    timelines`` is the module ``commsched.sim.timelines``, ``from commsched.sim import Measured`` the
    package's facade ``commsched.sim``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            ]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"commsched(\.\w+)+", node.value)
        ):
            names = [node.value]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_loop_between_the_package_modules():
    """Nor between two files: a module that imports another (even inside a function) is never imported
    back by it, directly or around a circle (a package's `__init__` re-exporting its modules counts)."""
    sources = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {
        name: {
            other: {str(source.relative_to(ROOT))} for other in modules_imported(source, set(sources)) if other != name
        }
        for name, source in sources.items()
    }
    assert loops(edges) == []


FIND_IT = re.compile(r"`(src/commsched/[\w/]+\.py)`: `([\w.]+)`")


def defined(source: Path, dotted: str) -> bool:
    """`dotted` (``decide``, ``DeARSchedule._apply``) is a `def` or `class` of `source`, a method inside its class."""
    scopes: list[ast.AST] = [ast.parse(source.read_text())]
    for name in dotted.split("."):
        found = [
            node
            for scope in scopes
            for node in ast.walk(scope)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name
        ]
        if not found:
            return False
        scopes = found
    return True


def test_find_it_in_30_seconds_names_real_files_and_functions():
    """docs/architecture.md's "Find it in 30 seconds" list cannot rot: every file it names exists and
    defines the function or class named beside it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Find it in 30 seconds", 1)[1].split("\n## ", 1)[0]
    items = [line for line in section.splitlines() if line.startswith("- ")]
    assert len(items) >= 6, (
        "the list asks where DeAR's reduce-scatter starts, a bucket's update is applied, DeFT decides, ..."
    )
    missing = []
    for item in items:
        places = FIND_IT.findall(item)
        assert places, f"an item names no `src/commsched/FILE.py`: `NAME`: {item}"
        for path, name in places:
            source = ROOT / path
            if not source.is_file() or not defined(source, name):
                missing.append(f"{path}: {name}")
        for name in re.findall(r"(?<!: )`([A-Z]\w*\.\w+)`", item):  # `Class.method` after the file was named once
            if not any(defined(ROOT / path, name) for path, _ in places):
                missing.append(f"{places[-1][0]}: {name}")
    assert missing == []


SHARED_MODULE_NAMES = {
    "__init__": "a package",
    "cli": "a command's entry point in its folder (bench, cluster, planning, profile, sim)",
    "config": "a command's typed configuration (cli, bench)",
    "base": "a folder's base class (schedules, reducers, data)",
    "dear": "a schedule and its options (schedules/, options/)",
    "deft": "a schedule and its options (schedules/, options/)",
    "links": "the links and their options (comm/, options/)",
    "strategy": "the strategy and its options (runtime/, options/)",
}
"""Module names several folders use, each for the same role in its folder; any other name is one concept's."""


def test_one_name_per_concept():
    """No two public classes or top-level functions of the package share a name (an entry point's
    `main` aside), and no two modules do unless the name is a role every folder gives it (`SHARED_MODULE_NAMES`)."""
    modules: dict[str, list[str]] = {}
    definitions: dict[str, list[str]] = {}
    for source in sorted(PACKAGE.rglob("*.py")):
        where = str(source.relative_to(PACKAGE))
        modules.setdefault(source.stem, []).append(where)
        for node in ast.parse(source.read_text()).body:
            if (
                isinstance(node, (ast.ClassDef, ast.FunctionDef))
                and not node.name.startswith("_")
                and node.name != "main"
            ):
                definitions.setdefault(node.name, []).append(where)
    assert {name: where for name, where in modules.items() if len(where) > 1 and name not in SHARED_MODULE_NAMES} == {}
    assert {name: where for name, where in definitions.items() if len(where) > 1} == {}


def _modules_mentioning(pattern: str) -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if re.search(pattern, path.read_text()):
            found.add(str(path.relative_to(PACKAGE)))
    return found


def test_one_owner_for_what_a_schedule_takes_and_for_the_second_network():
    """The checks of what only some schedules take run in one function, which the strategy and
    commsched-train both call; the environment variable naming the second network is read in one place."""
    assert _modules_mentioning(r"\bcheck_(compression|streams)\(") == {
        "options/compression.py",
        "options/streams.py",
        "options/strategy.py",
    }
    assert _modules_mentioning(r"check_schedule_takes\(") == {
        "options/strategy.py",
        "runtime/arguments.py",
        "cli/config.py",
    }
    assert _modules_mentioning(r"COMMSCHED_SECONDARY_IFNAME") - {"cluster/launch.py"} == {"options/links.py"}


def test_the_second_network_comes_from_the_option_else_the_node(monkeypatch):
    from commsched.options import LinkOptions

    monkeypatch.delenv("COMMSCHED_SECONDARY_IFNAME", raising=False)
    assert LinkOptions().secondary_interface() is None
    monkeypatch.setenv("COMMSCHED_SECONDARY_IFNAME", "eth1")
    assert LinkOptions().secondary_interface() == "eth1"
    assert LinkOptions(secondary_ifname="lo").secondary_interface() == "lo"
