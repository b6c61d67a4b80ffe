"""No import cycles among lazyrag's modules: every import a module makes of another (at its top,
under `if TYPE_CHECKING:`, or deferred inside a function) is an edge, and the graph must have no
cycle, so that the layers of docs/architecture.md hold and no import is deferred to dodge one."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the repository's kernels/ folder is installed as lazyrag.kernels
PACKAGES = {"lazyrag": ROOT / "lazyrag", "lazyrag.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    """Every module's dotted name (a package's is its __init__'s) and its file."""
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The lazyrag modules that module `name` (at `path`) imports, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:  # `from pkg import module` imports the module; a name, the module it is in
                targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    # a package is imported before its modules: a module naming its own package adds no edge
    return {t for t in targets if t in known and not name.startswith(t + ".") and t != name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), as a path."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path(graph, group) for group in groups]


def _path(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A cycle inside `group`, from its first module back to it."""
    start = min(group)
    seen, frontier = {start: [start]}, [start]
    while frontier:
        v = frontier.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                return seen[v] + [start]
            if w not in seen:
                seen[w] = seen[v] + [w]
                frontier.append(w)
    return sorted(group)


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walk_sees_relative_and_package_imports():
    graph = import_graph()
    assert "lazyrag.store.catalog" in graph["lazyrag.store.runlog"]  # from .catalog import Catalog
    assert "lazyrag.commands.answer_engine" in graph["lazyrag.commands.answer"]
    assert "lazyrag.commands.answer" in graph["lazyrag.cli"]  # deferred, inside the command


def test_lazyrag_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (move the shared type into the lower module):\n" + "\n".join(
        " -> ".join(c) for c in found)
