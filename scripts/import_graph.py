"""phos's import graph: which module imports which, and every cycle among modules or packages.

    python scripts/import_graph.py            # the cycles; exits 1 when there is one
    python scripts/import_graph.py --edges    # every edge, module -> module

Reads the source (no module is imported), maps folders to module names as pyproject's
package-dir does, and counts every `import phos...` and `from phos... import`, lazy ones inside
functions too: a cycle broken by a lazy import is still a cycle for a reader.
A package's edges are its modules' edges, lifted to the package each side belongs to; a package
and its parent are two rooms (phos.gpu_server.backends.ptx is not phos.gpu_server, nor phos).
"""
import argparse
import ast
import os
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_dirs():
    """{package: folder} of every package pyproject lists, placed as its package-dir says."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    mapped = setup["package-dir"]
    out = {}
    for package in setup["packages"]:
        prefix = max((p for p in mapped if package == p or package.startswith(p + ".")), key=len)
        out[package] = os.path.join(mapped[prefix], *package[len(prefix):].split(".")[1:])
    return out


def modules():
    """{module name: file} of every module of phos."""
    found = {}
    for package, folder in package_dirs().items():
        base = os.path.join(ROOT, folder)
        for name in os.listdir(base):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                found[module] = os.path.join(base, name)
    return found


def imports(path, known):
    """The phos modules the file at path imports (a `from P import m` of a submodule counts as P.m)."""
    tree = ast.parse(open(path).read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:      # `import phos.x.y.z` where z is a class
                name = name.rpartition(".")[0]
            if name.startswith("phos"):
                out.add(name)
    return out


def graph():
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def package_of(module, packages):
    return module if module in packages else module.rpartition(".")[0]


def package_graph(edges):
    packages = set(package_dirs())
    lifted = {}
    for m, targets in edges.items():
        src = package_of(m, packages)
        for t in targets:
            dst = package_of(t, packages)
            if dst != src:
                lifted.setdefault(src, set()).add(dst)
    return lifted


def cycles(edges):
    """Every strongly connected component of more than one node (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="print every module -> module edge")
    args = ap.parse_args()
    edges = graph()
    if args.edges:
        for m in sorted(edges):
            for t in sorted(edges[m]):
                print(f"{m} -> {t}")
        return 0
    bad = 0
    for kind, g in (("module", edges), ("package", package_graph(edges))):
        for c in cycles(g):
            bad += 1
            print(f"{kind} cycle: {' <-> '.join(c)}")
    if not bad:
        print("no import cycle among phos's modules or packages")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
