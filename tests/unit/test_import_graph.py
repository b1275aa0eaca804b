"""The house's rule (scripts/import_graph.py): no import cycle among phos's modules, nor among its
packages: phos.base is the ground every package may stand on, phos's command lines and the pool
the roof, and gpu_server's rooms point one way (control -> worker -> backends)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import import_graph  # noqa: E402


def test_the_finder_sees_a_cycle_and_a_lazy_import(tmp_path):
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from phos.gpu_server.worker import loop\n")
    assert import_graph.imports(str(src), {"phos.gpu_server.worker", "phos.gpu_server.worker.loop"}) == {
        "phos.gpu_server.worker.loop"}


def test_no_module_imports_itself_round_a_cycle():
    assert import_graph.cycles(import_graph.graph()) == []


def test_no_package_imports_itself_round_a_cycle():
    edges = import_graph.graph()
    assert import_graph.cycles(import_graph.package_graph(edges)) == []


def test_the_ground_imports_nothing_above_it():
    edges = import_graph.graph()
    assert {t for m, ts in edges.items() if m.startswith("phos.base") for t in ts if not t.startswith("phos.base")} == set()
