"""The package's shape (tools/import_graph.py): imports never go in a circle, no module or
function is longer than a reader can hold at once."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tools'))
import import_graph  # noqa: E402


def test_no_import_circle():
    graph = import_graph.import_graph()
    assert {'engine', 'runner', 'speculative', 'loading'} <= set(graph)
    assert import_graph.circles(graph) == []


def test_circles_are_found_through_lazy_imports(tmp_path, monkeypatch):
    "A circle closed by an import inside a function is still a circle (as engine/speculative was)."
    pkg = tmp_path / 'petite_llm'
    pkg.mkdir()
    (pkg / 'engine.py').write_text('def build():\n    from petite_llm.speculative import S\n')
    (pkg / 'speculative.py').write_text('from .engine import build\nS = 1\n')
    (pkg / 'sampling.py').write_text('import petite_llm.engine\n')
    monkeypatch.setattr(import_graph, 'PKG', pkg)
    graph = import_graph.import_graph()
    assert graph == {'engine': {'speculative'}, 'speculative': {'engine'}, 'sampling': {'engine'}}
    assert import_graph.circles(graph) == [['engine', 'speculative', 'engine']]


def test_modules_and_functions_stay_readable():
    assert import_graph.long_modules() == {}
    assert import_graph.long_functions() == {}
