"""The engine's own figures: the kernel counter counts what it should, and the figures are sane.

No timing is asserted: only that the counts are right and the times are positive and finite."""
import json, math, os, subprocess, sys, textwrap

import torch

from petite_llm.bench.host import LaunchCounter, engine_table, host_work


def _in_interpreter(code: str) -> dict:
    "Run code in a fresh Python with TRITON_INTERPRET=1; its last printed line, as JSON."
    done = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True,
                          text=True, env={**os.environ, 'TRITON_INTERPRET': '1'})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_views_and_no_op_conversions_are_free_and_each_kernel_counts_once():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with LaunchCounter() as counter:
        x.view(2, 16).reshape(4, 8).t().unsqueeze(0).detach()     # views: nothing launched
        torch.empty(3)                                            # an allocation
        z = torch.relu(x @ w + 1)                                 # 3 kernels
        z.to(torch.float32).contiguous().reshape(32)              # nothing moves
        z.t().contiguous()                                        # a copy: 1 kernel
        z.t().reshape(32)                                         # a copy: 1 kernel
        z.to(torch.float64)                                       # a conversion: 1 kernel
    assert counter.total == 6, counter.launches
    assert sum(counter.skipped.values()) > 0


def test_a_counter_is_left_behind_cleanly():
    with LaunchCounter() as counter:
        torch.ones(2) + 1
    n = counter.total
    torch.ones(2) + 1                                              # outside: not counted
    assert counter.total == n == 2


def test_a_triton_kernel_launched_twice_counts_two_and_hides_the_interpreters_ops():
    launches = _in_interpreter('''
        import json, torch, triton, triton.language as tl
        from petite_llm.bench.host import LaunchCounter

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

        x = torch.zeros(100)
        with LaunchCounter() as counter:
            for _ in range(2):
                add_one[(4,)](x, 100, BLOCK=32)
        assert x.eq(2).all()
        print(json.dumps(counter.launches))''')
    assert launches == {'triton.add_one': 2}


def test_kernels_per_layer_are_positive_and_the_same_for_every_pair_of_depths():
    figures = _in_interpreter('''
        import json
        from petite_llm.bench.host import launches_per_layer
        print(json.dumps([launches_per_layer((1, 2)), launches_per_layer((2, 3))]))''')
    one_two, two_three = figures
    for backend in ('triton', 'torch'):
        assert one_two[backend]['per_layer'] > 0
        assert one_two[backend]['per_layer'] == two_three[backend]['per_layer']
        assert one_two[backend]['per_layer_ops'] == two_three[backend]['per_layer_ops']
        assert one_two[backend]['steps']['2'] == two_three[backend]['steps']['2']
    # the triton backend's attention and KV store are Triton kernels, once per layer
    assert any(k.startswith('triton.') for k in one_two['triton']['per_layer_ops'])
    assert not any(k.startswith('triton.') for k in one_two['torch']['per_layer_ops'])


def test_host_work_is_positive_and_finite_and_split_into_parts():
    fig = host_work(batch=4, steps=3, warm_up=1)
    assert fig['batch'] == 4
    for k in ('step_ms', 'host_ms', 'host_us_per_seq_step'):
        assert math.isfinite(fig[k]) and fig[k] > 0
    assert all(math.isfinite(v) for v in fig['parts'].values())
    assert fig['host_us_per_seq_step'] == fig['host_ms'] * 1e3 / 4


def test_the_table_puts_each_goal_beside_its_figure():
    res = dict(launches_per_layer=dict(triton=49.0, torch=57.0, goal=10),
               host_us_per_seq_step=dict(value=8.0, goal=10.0),
               host_ms_lone_step=dict(value=0.5, goal=0.25))
    lines = engine_table(res).splitlines()
    assert len(lines) == 5
    assert '49' in lines[1] and '<= 10' in lines[1] and 'not yet' in lines[1]
    assert '8.0' in lines[3] and lines[3].endswith('met')
    assert '0.500' in lines[4] and lines[4].endswith('not yet')
