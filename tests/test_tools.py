"""The book's tools: directives, the reader's view, `make book` hashes, stale outputs."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_NOTEBOOKS = [sys.executable, str(ROOT / 'tools' / 'run_notebooks.py')]
sys.path.insert(0, str(ROOT / 'tools'))
import check_outputs  # noqa: E402
import export  # noqa: E402
import nbtools  # noqa: E402
import toc  # noqa: E402


def code(src, outputs=(), **meta):
    return {'cell_type': 'code', 'source': src, 'outputs': list(outputs), 'metadata': meta,
            'execution_count': None}


def md(src):
    return {'cell_type': 'markdown', 'source': src, 'metadata': {}}


def stream(text):
    return {'output_type': 'stream', 'name': 'stdout', 'text': [text]}


@pytest.mark.parametrize('src,flag', [
    ('#| slow\nx=1', 'slow'), ('#|slow\nx=1', 'slow'), ('#|  gpu\nx=1', 'gpu'),
    ('#| export\n#| slow\nx=1', 'slow'), ('#| eval: false\nx=1', 'eval: false'),
    ('#| export\nx=1', None), ('x=1\n#| slow', None), ('# slow\nx=1', None)])
def test_skipped_by_reads_leading_directives_only(src, flag):
    assert nbtools.skipped_by(code(src)) == flag


def test_skipped_by_runs_flags_asked_for():
    assert nbtools.skipped_by(code('#| slow\nx=1'), run_flags={'slow'}) is None
    assert nbtools.skipped_by(code('#| gpu\nx=1'), run_flags={'slow'}) == 'gpu'


def test_book_view_strips_directives_and_drops_hidden_cells():
    out = [stream('hi\n')]
    nb = {'cells': [code('#| default_exp toy'), md('# Toy\n> summary'), code('#| hide\nsecret()'),
                    code('#| export\ndef f(): pass'), code('#| slow\nprint("hi")', out),
                    code('#| echo: false\nplot()'), code('#| include: false\nx = 1')],
          'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    cells = nbtools.book_view(nb)['cells']
    assert [c['source'] for c in cells] == ['# Toy\n> summary', 'def f(): pass', 'print("hi")',
                                            'plot()']
    assert cells[2]['outputs'] == out  # saved outputs of a skipped cell stay on the page
    assert cells[3]['metadata']['tags'] == ['remove-input']
    assert not any('#|' in c['source'] for c in cells)


def write_nb(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.from_dict(c) for c in cells]
    for i, c in enumerate(nb.cells):
        c['id'] = f'c{i}'
    nbformat.write(nb, path)
    return path


def test_check_outputs_finds_stale_missing_and_error_outputs(tmp_path):
    fresh = code('print(1)', [stream('1\n')])
    fresh['metadata'] = {'petite_llm': {'source_hash': nbtools.source_hash(fresh)}}
    edited = code('print(2)', [stream('1\n')],
                  petite_llm={'source_hash': nbtools.source_hash(code('print(1)'))})
    by_hand = code('#| slow\nprint(3)', [stream('3\n')])
    raised = {'output_type': 'error', 'ename': 'ZeroDivisionError', 'evalue': '', 'traceback': []}
    error = code('1/0', [raised],
                 petite_llm={'source_hash': nbtools.source_hash(code('1/0'))})
    silent = code('x = 1')  # prints nothing, but was never run: its outputs are unknown
    nb = write_nb(tmp_path / '03_x.ipynb', [fresh, edited, by_hand, error, silent])
    msgs = check_outputs.problems(nb, is_chapter=True)
    assert len(msgs) == 4, msgs
    assert 'cell 4' in msgs[3] and 'never run' in msgs[3]
    assert 'cell 1' in msgs[0] and 'edited after' in msgs[0]
    assert 'cell 2' in msgs[1] and 'no source hash' in msgs[1] and 'FLAGS=slow' in msgs[1]
    assert 'cell 3' in msgs[2] and 'error' in msgs[2]
    assert check_outputs.problems(write_nb(tmp_path / '04_y.ipynb', [fresh]), is_chapter=True) == []


def test_check_outputs_fails_stderr_progress_bars_and_machine_paths(tmp_path):
    "What a reader should not see fails the check; run_notebooks leaves stderr out of a run."
    def ran(src, outs):
        cell = code(src, outs)
        cell['metadata'] = {'petite_llm': {'source_hash': nbtools.source_hash(cell)}}
        return cell
    err = stream('max_model_len lowered\n')
    err['name'] = 'stderr'
    cells = [ran('warn()', [err]), ran('bar()', [stream('\rloading: 50%|#    | 1/2\n')]),
             ran('where()', [stream('/tmp/pytest-of-root/x/model.gguf\n')]),
             ran('fine()', [stream('model.gguf, 3 of 4 tensors\n')])]
    msgs = check_outputs.problems(write_nb(tmp_path / '09_n.ipynb', cells), is_chapter=True)
    assert len(msgs) == 3, msgs
    assert 'cell 0' in msgs[0] and 'stderr' in msgs[0]
    assert 'cell 1' in msgs[1] and 'a progress bar' in msgs[1]
    assert 'cell 2' in msgs[2] and 'a path of the machine' in msgs[2]
    nb = write_nb(tmp_path / '10_run.ipynb', [
        md('# Run'), code('import sys; print("out"); print("log", file=sys.stderr)')])
    subprocess.run(RUN_NOTEBOOKS + [str(nb)], check=True, cwd=ROOT, capture_output=True)
    outs = json.loads(nb.read_text())['cells'][1]['outputs']
    assert [(o['name'], ''.join(o['text'])) for o in outs] == [('stdout', 'out\n')]
    assert check_outputs.problems(nb, is_chapter=True) == []


def test_check_outputs_fails_a_chapter_never_built(tmp_path):
    nb = write_nb(tmp_path / '05_z.ipynb', [md('# Z'), code('x = 1')])
    assert 'never built' in check_outputs.problems(nb, is_chapter=True)[0]
    assert check_outputs.problems(nb, is_chapter=False) == []


def test_run_notebooks_saves_outputs_and_hashes_keeps_flagged_outputs(tmp_path):
    kept = [stream('measured on a GPU\n')]
    nb = write_nb(tmp_path / '06_run.ipynb', [
        md('# Run'), code('#| export\ndef double(x): return 2 * x'),
        code('print(double(21))', [stream('stale\n')]),
        code('#| gpu\nraise RuntimeError("must not run")', kept), code('double(5)'),
        code('#| slow\nprint("slow")')])
    subprocess.run(RUN_NOTEBOOKS + [str(nb)], check=True, cwd=ROOT, capture_output=True)
    cells = json.loads(nb.read_text())['cells']
    assert ''.join(cells[2]['outputs'][0]['text']) == '42\n'
    assert cells[3]['outputs'] == kept and 'petite_llm' not in cells[3]['metadata']
    assert cells[4]['outputs'][0]['data']['text/plain'] == ['10']
    assert cells[5]['outputs'] == []
    assert check_outputs.problems(nb, is_chapter=True) == [
        f'06_run.ipynb: cell 3 (id c3, "#| gpu") has outputs but no source hash: saved by hand, '
        'not by `make book` (a `gpu` cell: `make book FLAGS=gpu` runs it)']
    for c in cells[1:3] + cells[4:5]:
        assert c['metadata']['petite_llm']['source_hash'] == nbtools.source_hash(c)


def test_run_notebooks_only_flagged_keeps_the_other_outputs(tmp_path):
    "--only-flagged runs every cell but saves outputs only where a flag it names is set."
    cpu = [stream('measured on the CPU build\n')]
    nb = write_nb(tmp_path / '08_gpu.ipynb', [
        code('x = 21', cpu), code('#| slow\nprint(2 * x)'), code('#| gpu\nraise RuntimeError')])
    subprocess.run(RUN_NOTEBOOKS + ['--flags', 'slow', '--only-flagged', str(nb)], check=True,
                   cwd=ROOT, capture_output=True)
    cells = json.loads(nb.read_text())['cells']
    assert cells[0]['outputs'] == cpu and 'petite_llm' not in cells[0]['metadata']
    assert ''.join(cells[1]['outputs'][0]['text']) == '42\n'   # it saw x: the first cell ran
    assert cells[1]['metadata']['petite_llm']['source_hash'] == nbtools.source_hash(cells[1])
    r = subprocess.run(RUN_NOTEBOOKS + ['--only-flagged', str(nb)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 2 and 'give --flags too' in r.stderr


def test_run_notebooks_plan_counts_the_cells_and_runs_none(tmp_path):
    "--plan: what a run with these flags would run and save; the notebook is left as it was."
    nb = write_nb(tmp_path / '09_plan.ipynb', [
        md('# t'), code('1/0'), code('#| gpu\n1/0'), code('#| slow\n1/0'),
        code('#| eval: false\n1/0')])
    before = nb.read_text()
    for args, line in [([], 'would run 1 cells and save 1, skip 3'),
                       (['--flags', 'gpu', '--only-flagged'], 'would run 2 cells and save 1, skip 2'),
                       (['--flags', 'slow gpu'], 'would run 3 cells and save 3, skip 1')]:
        r = subprocess.run(RUN_NOTEBOOKS + ['--plan', *args, str(nb)], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == f'09_plan.ipynb: {line}\n', (args, r)
    assert nb.read_text() == before


def test_run_notebooks_does_not_save_a_failing_notebook(tmp_path):
    nb = write_nb(tmp_path / '07_fail.ipynb', [code('print("ok")'), code('1/0')])
    before = nb.read_text()
    r = subprocess.run(RUN_NOTEBOOKS + [str(nb)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and 'ZeroDivisionError' in r.stderr and 'NOT saved' in r.stderr
    assert nb.read_text() == before


def test_toc_lists_every_chapter_in_order():
    yml = toc.toc_yml()
    files = [l.split('file: ')[1] for l in yml.splitlines() if 'file: ' in l]
    assert files == [f'nbs/{p.stem}' for p in nbtools.chapters()]
    assert 'root: nbs/index' in yml


def test_readme_starts_with_make_demo_then_make_test():
    import make_readme
    text = make_readme.readme_text()
    first_block = text.split('```sh\n', 1)[1].split('```', 1)[0]
    cmds = [l.split('#')[0].strip() for l in first_block.splitlines()]
    assert cmds[:2] == ['make demo', 'make test']
    assert 'LLM("Qwen/Qwen3-0.6B")' in text and 'make test-slow' in text and 'make book' in text


def test_promises_picture():
    assert nbtools.promises_picture({'cells': [code("plt.savefig('../images/a.png')")]})
    assert nbtools.promises_picture({'cells': [md('![](../images/a.png)')]})
    assert nbtools.promises_picture({'cells': [code("#| slow\nplt.savefig('../images/a.png')")]})
    assert not nbtools.promises_picture({'cells': [code("#| gpu\nplt.savefig('../images/a.png')")]})
    ran_on_gpu = code("#| gpu\nplt.savefig('../images/a.png')", [stream('x')])
    assert nbtools.promises_picture({'cells': [ran_on_gpu]})
    assert not nbtools.promises_picture({'cells': [md('no pictures'), code('x = 1')]})


def test_check_outputs_fails_a_chapter_cell_never_run(tmp_path):
    "A chapter's cell added after `make book` ran is missing its run, printing or not."
    ran = code('x = 1')
    ran['metadata'] = {'petite_llm': {'source_hash': nbtools.source_hash(ran)}}
    nb = write_nb(tmp_path / '11_new.ipynb', [md('# New'), ran, code('y = 2'),
                                              code('#| slow\nz = 3')])
    msgs = check_outputs.problems(nb, is_chapter=True)
    assert len(msgs) == 1 and 'cell 2' in msgs[0] and 'never run' in msgs[0], msgs
    assert check_outputs.problems(nb, is_chapter=False) == []


def test_check_outputs_allows_a_chapter_with_nothing_to_run(tmp_path):
    nb = write_nb(tmp_path / '08_prose.ipynb', [md('# Prose only'), code('#| gpu\nrun_on_gpu()')])
    assert check_outputs.problems(nb, is_chapter=True) == []


def test_run_notebooks_refuses_a_path_given_as_a_flag(tmp_path):
    nb = write_nb(tmp_path / '09_flags.ipynb', [code('print(1)')])
    r = subprocess.run(RUN_NOTEBOOKS + ['--flags', f'slow {nb}'],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and 'unknown flag' in r.stderr
    assert json.loads(nb.read_text())['cells'][0]['outputs'] == []


def test_export_resets_modules_that_no_notebook_creates():
    "The modules fed only by `#| export mod` are found, and reset to a header nbdev appends to."
    defaults, others = export.module_names()
    assert {'engine.paging', 'engine.llm_engine', 'model.layers.attention'} <= defaults
    assert others['engine.backends'] == '11_paged_blocks.ipynb'
    assert others['model.layers.linear'] == '03_attention.ipynb'
    assert not defaults & set(others)
    docs = export.module_docs()
    header = export.empty_module('model.layers.linear', '03_attention.ipynb',
                                 docs['model.layers.linear'])
    assert header.startswith('"""Fused q/k/v and gate/up linears')
    assert '# AUTOGENERATED! DO NOT EDIT! File to edit: ../../../nbs/03_attention' in header
    assert header.index('from __future__') < header.index('__all__ = []')
    # what the reset module starts with is what the committed one starts with
    for name, notebook in others.items():
        committed = (ROOT / 'petite_llm' / (name.replace('.', '/') + '.py')).read_text()
        start = export.empty_module(name, notebook, docs[name]).split('# %% auto')[0]
        assert committed.startswith(start)
        assert committed.count('\n# %% ../') == len(set(committed.split('\n# %% ../')[1:]))


def test_every_subpackage_says_what_it_holds():
    "Each part's __init__.py is its docstring, its chapters read from the notebooks; no import."
    chapters = export.package_chapters()
    assert 19 in chapters['model'] and 20 not in chapters['engine'] and chapters['cli'] == {90}
    for name in export.PACKAGES:
        text = (ROOT / 'petite_llm' / name.replace('.', '/') / '__init__.py').read_text()
        assert text.startswith(f'"""{export.package_doc(name, chapters[name])}"""')
        assert 'import' not in text.split('"""')[2]


@pytest.mark.parametrize('numbers,words', [
    ([17], 'chapter 17'), ([18, 17], 'chapters 17 and 18'), ([20, 21, 22], 'chapters 20-22'),
    ([0, 1, 2, 3, 15, 19, 23], 'chapters 00-03, 15, 19 and 23'),
    ([1, 2, 5, 7, 8, 9], 'chapters 01, 02, 05 and 07-09')])
def test_chapter_lists_read_as_prose(numbers, words):
    assert export.chapters(numbers) == words


# --- tools/check_devices.py: chapters that reach Triton choose their device once -----------------
import check_devices  # noqa: E402
import chapter_models  # noqa: E402

RESOLVER = "device = 'cuda' if torch.cuda.is_available() else 'cpu'"
IMPORTS_TRITON = '#| export\nimport triton\nfrom petite_llm.engine.backends import AttentionBackend'
# chapter 13 before the fix (commit d74f020): a CPU default fed to a compiled kernel
OLD_13_HELPER = ("def random_batch(seqs, block_size, num_heads, num_kv_heads, head_dim,\n"
                 "                 dtype=torch.float32, seed=0, device='cpu'):\n"
                 "    return torch.randn(3, device=device)")
OLD_13_BACKENDS = ("args = (tables, done, new, block_size, 'cpu')\n"
                   "out = TritonAttentionBackend(num_sms=64).forward(q, k, v, pool, md, 0.1)")
# chapter 14 before the fix: the triton backend over a CPU model, a model copied to the CPU
OLD_14_TRITON = ("eager = LLMEngine(tiny, attention_backend='triton', block_size=4,\n"
                 "                  kv_cache_memory=2**20, enforce_eager=True)")
OLD_14_COPY = "net = copy.deepcopy(tiny).to('cpu', dtype)"


def devices_nb(*sources):
    return {'cells': [code(s) for s in sources]}


def test_check_devices_fails_on_the_old_chapters():
    old_13 = check_devices.problems(devices_nb(IMPORTS_TRITON, OLD_13_HELPER, OLD_13_BACKENDS))
    assert any('never chooses its device' in m for m in old_13)
    assert sum("'cpu' hard-codes the CPU" in m for m in old_13) == 2
    assert any('asks for the triton backend' in m for m in old_13)
    old_14 = check_devices.problems(devices_nb(OLD_14_TRITON, OLD_14_COPY))
    assert any('never chooses its device' in m for m in old_14)
    assert any("cell 1 " in m and "'cpu'" in m for m in old_14)
    assert any('cell 0 ' in m and 'asks for the triton backend' in m for m in old_14)


def test_check_devices_passes_the_fixed_chapters():
    new_13 = devices_nb(IMPORTS_TRITON, RESOLVER, OLD_13_HELPER.replace("'cpu'", 'device'),
                        OLD_13_BACKENDS.replace("'cpu'", 'device'))
    assert check_devices.problems(new_13) == []
    new_14 = devices_nb(RESOLVER, OLD_14_TRITON.replace('(tiny,', '(tiny.to(device),'),
                        OLD_14_COPY.replace("'cpu'", 'device'))
    assert check_devices.problems(new_14) == []


@pytest.mark.parametrize('src', [
    "# stays on the CPU: asks about this CPU's bf16\nprint(native_bf16('cpu'))",
    "x = f(1,\n      'cpu')  # stays on the CPU: the host copy",
    "def f(d='cpu'):  # stays on the CPU: a host helper\n    return d",
    "import torch\n# stays on the CPU: oneDNN's kernels are CPU kernels\nx = t.to('cpu')"])
def test_check_devices_accepts_a_cpu_line_that_says_why(src):
    assert check_devices.problems(devices_nb(IMPORTS_TRITON, RESOLVER, src)) == []


@pytest.mark.parametrize('src', [
    "x = t.cpu()", "y = torch.zeros(3, device='cpu')",
    "# stays on the CPU:\nx = t.to('cpu')",                  # a reason is required
    "z = 1\n# stays on the CPU: host\nw = 2\nx = t.to('cpu')",  # not the statement below it
    "def f():  # stays on the CPU: host\n    return 1\ny = t.cpu()"])
def test_check_devices_flags_an_unexplained_cpu_line(src):
    found = check_devices.problems(devices_nb(IMPORTS_TRITON, RESOLVER, src))
    assert len(found) == 1 and 'hard-codes the CPU' in found[0], found


def test_check_devices_reads_only_cells_ci_runs_in_chapters_that_reach_triton():
    flagged = ["#| gpu\nx = t.cpu()", "#| slow\nx = t.cpu()", "#| export\ndef f(d='cpu'): pass"]
    assert check_devices.problems(devices_nb(IMPORTS_TRITON, RESOLVER, *flagged)) == []
    # no Triton anywhere: the CPU is as good a device as any
    assert check_devices.problems(devices_nb("x = t.to('cpu')")) == []
    # the backend's name in an option list is not a request for it
    choices = "#| export\np.add_argument('--attention-backend', choices=['torch', 'triton'])"
    assert check_devices.problems(devices_nb(choices, "x = t.cpu()")) == []


def test_check_devices_passes_chapter_13():
    assert check_devices.problems(nbtools.read_nb(ROOT/'nbs'/'13_triton_kernels.ipynb')) == []


# --- tools/chapter_models.py: which chapters load a real model -------------------------------


def test_chapter_models_follows_the_package_to_the_model():
    loaders = chapter_models.model_loaders()
    assert {'smollm2_gguf_path', 'default_model', 'real_model', 'run_batch_sweep'} <= loaders
    assert not {'LLM', 'load_model', 'make_random_checkpoint'} & loaders


def test_chapter_models_ignores_a_local_name_that_shadows_a_loader(tmp_path):
    "A function whose own argument or variable is called `run` does not reach the package's run."
    (tmp_path / 'm.py').write_text(
        "def run():\n    return smollm2_gguf_path()\n\n"
        "def calls(run):\n    return run()\n\n"
        "def binds(x):\n    run = x\n    return run()\n\n"
        "def reaches():\n    return run()\n")
    loaders = chapter_models.model_loaders(tmp_path)
    assert {'run', 'reaches'} <= loaders and not {'calls', 'binds'} & loaders


@pytest.mark.parametrize('sources,needs', [
    (["from petite_llm.model.weights import smollm2_gguf_path\npath = smollm2_gguf_path()"], True),
    (["model = os.environ.get('PETITE_LLM_MODEL') or default_model()"], True),
    (["sweep = run_batch_sweep(batch_sizes=(1, 3))"], True),          # through the package
    (["!petite-llm generate --max-tokens 4 hi", "res = main(['generate', 'hi'])"], True),
    (["#| slow\npath = smollm2_gguf_path()", "x = 1"], False),        # the GPU session skips it
    (["def run(steps):\n    return steps", "run(3)"], False),        # the chapter's own `run`
    (["#| gpu\nllm = LLM(make_random_checkpoint(), device='cuda')"], False)])
def test_chapter_models_reads_what_a_chapter_loads(sources, needs):
    nb = {'cells': [code(s) for s in sources]}
    assert chapter_models.needs_model(nb, chapter_models.model_loaders()) is needs


def test_chapter_models_splits_the_book():
    model, free = chapter_models.split_chapters()
    assert sorted(model + free) == [p.stem for p in nbtools.chapters()]
    assert {'06_weights', '18_benchmarks', '90_cli'} <= set(model)     # 90 asks SmolLM2 for Paris
    assert {'01_rmsnorm', '13_triton_kernels'} <= set(free)
