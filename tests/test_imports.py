"""The package's shape (tools/import_graph.py): the parts import one way (model, then engine and
parallel, serve, bench, cli), imports never go in a circle, every module says what it holds, and
no module or function is longer than a reader can hold at once."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tools'))
import import_graph  # noqa: E402


def test_parts_import_one_way():
    graph = import_graph.import_graph()
    assert {'engine.llm_engine', 'engine.runner', 'parallel.worker', 'cli.main'} <= set(graph)
    assert import_graph.outside_parts() == []
    assert import_graph.wrong_arrows(graph) == []
    assert ('engine', 'model') in import_graph.part_arrows(graph)


def test_no_import_circle():
    assert import_graph.circles(import_graph.import_graph()) == []


def test_every_module_has_a_docstring():
    assert import_graph.undocumented() == []


def _package(tmp_path, files: dict[str, str]) -> Path:
    "A stand-in petite_llm/ in tmp_path with these modules (path -> source)."
    pkg = tmp_path / 'petite_llm'
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_circles_are_found_through_lazy_imports(tmp_path, monkeypatch):
    "A circle closed by an import inside a function is still a circle (as engine/speculative was)."
    monkeypatch.setattr(import_graph, 'PKG', _package(tmp_path, {
        'engine/llm_engine.py': 'def build():\n    from petite_llm.engine.speculative import S\n',
        'engine/speculative.py': 'from .llm_engine import build\nS = 1\n',
        'model/sampling.py': 'import petite_llm.engine.llm_engine\n'}))
    graph = import_graph.import_graph()
    assert graph == {'engine.llm_engine': {'engine.speculative'},
                     'engine.speculative': {'engine.llm_engine'},
                     'model.sampling': {'engine.llm_engine'}}
    assert import_graph.circles(graph) == [['engine.llm_engine', 'engine.speculative',
                                            'engine.llm_engine']]


def test_an_arrow_up_the_levels_and_a_missing_docstring_are_found(tmp_path, monkeypatch):
    "model importing serve points up; engine and parallel may import each other; no docstring."
    monkeypatch.setattr(import_graph, 'PKG', _package(tmp_path, {
        'model/qwen3.py': '"""Qwen3."""\nfrom ..serve.server import app\n',
        'serve/server.py': '"""The server."""\napp = 1\n',
        'engine/runner.py': '"""The runner."""\nfrom ..parallel.worker import W\n',
        'parallel/worker.py': 'from ..engine.runner import R\nW = 1\n',
        'tools.py': '"""Outside every part."""\n'}))
    graph = import_graph.import_graph()
    assert import_graph.wrong_arrows(graph) == [('model.qwen3', 'serve.server')]
    assert import_graph.undocumented() == ['parallel.worker']
    assert import_graph.outside_parts() == ['tools']


def test_modules_and_functions_stay_readable():
    assert import_graph.long_modules() == {}
    assert import_graph.long_functions() == {}
