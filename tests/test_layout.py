"""The house's import rules: packages import only downward (offline and serve -> spec -> ling ->
moe -> pallas_kernels), function-local imports included, and no two modules import each other
(directly or around a longer circle)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVEL = {"pallas_kernels": 0, "moe": 1, "ling": 2, "spec": 3, "serve": 4, "offline": 4}


def modules():
    for package in LEVEL:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    yield name, path


def imports(path):
    """(line, imported module) of every import in the file, at any depth."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)


def test_imports_only_go_downward():
    upward = []
    for name, path in modules():
        here = LEVEL[name.split(".")[0]]
        for line, target in imports(path):
            top = target.split(".")[0]
            if top in LEVEL and LEVEL[top] > here or (top == "offline" != name.split(".")[0]):
                upward.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target}")
    assert not upward, "imports against the direction offline/serve -> spec -> ling -> moe -> pallas_kernels:\n" + \
        "\n".join(upward)


def test_no_import_cycles():
    names = dict(modules())

    def edges(path):  # `from a import b` depends on module a.b when there is one, else on a
        out = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                        for a in node.names}
        return out

    graph = {n: {t for t in edges(p) if t in names and t != n} for n, p in names.items()}
    state: dict[str, int] = {}

    def visit(n, trail):
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(m):] + [m]))
            if m not in state:
                visit(m, trail + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
