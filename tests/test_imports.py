"""The package's shape (tools/import_graph.py): the parts import one way (model, then engine and
parallel, serve, bench, cli), imports never go in a circle, every module says what it holds, no
module or function is longer than a reader can hold at once, and no class is redefined."""
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


def test_no_class_is_redefined():
    "Each class is complete where it is defined: no @patch or assignment over what it has."
    assert import_graph.redefinitions() == []


def test_redefinitions_are_found(tmp_path, monkeypatch):
    "A @patch or an assignment outside a class body, a second def in it, a class swap."
    monkeypatch.setattr(import_graph, 'PKG', _package(tmp_path, {
        'engine/scheduler.py': '''"""The scheduler."""
from fastcore.basics import patch

class Sequence:
    def __init__(self):
        self.num_computed_tokens = 0

    @property
    def num_tokens(self):
        return 1

    @num_tokens.setter
    def num_tokens(self, value):
        pass

class Scheduler:
    def update(self):
        return 1

    def update(self):
        return 2

@patch
def update(self: Scheduler):
    return 3

@patch
def abort(self: Scheduler):
    return 4

Sequence.num_pending = 0
Sequence.num_computed_tokens = 0
''',
        'engine/llm_engine.py': '''"""The engine."""
import fastcore.basics as fc
from .scheduler import Scheduler, Sequence as Seq

@fc.patch(as_prop=True)
def num_tokens(self: Seq):
    return 2

@fc.patch(cls_method=True)
def abort(cls: 'Scheduler'):
    return 5

Seq.num_pending = 1

def swap(seq):
    seq.__class__ = Scheduler
'''}))
    assert import_graph.redefinitions() == [
        ('engine.llm_engine', 6, 'Sequence', 'num_tokens', '@patch over engine.scheduler:9'),
        ('engine.llm_engine', 10, 'Scheduler', 'abort', '@patch over engine.scheduler:28'),
        ('engine.llm_engine', 13, 'Sequence', 'num_pending', 'assignment over engine.scheduler:31'),
        ('engine.llm_engine', 16, 'seq', '__class__', 'class swap'),
        ('engine.scheduler', 20, 'Scheduler', 'update', 'second def over engine.scheduler:17'),
        ('engine.scheduler', 24, 'Scheduler', 'update', '@patch over engine.scheduler:17'),
        ('engine.scheduler', 28, 'Scheduler', 'abort', '@patch outside the class body'),
        ('engine.scheduler', 31, 'Sequence', 'num_pending', 'assignment outside the class body'),
        ('engine.scheduler', 32, 'Sequence', 'num_computed_tokens',
         'assignment over engine.scheduler:6')]
