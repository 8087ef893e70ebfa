"""What a spawned tensor-parallel rank runs in tests/test_parallel.py: this module imports little,
so a rank starts in a moment (the test module itself imports transformers)."""
from pathlib import Path

import torch
import torch.distributed as dist

from petite_llm.parallel.tensor_parallel import ParallelLMHead


def lm_head_on_rank(rank, size, init_file, out_dir):
    "One rank of a vocabulary-split head of 10 rows (the last rank's padded): what it gets back."
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=size)
    torch.manual_seed(0)                                # every rank: the same head and input
    head, hidden = torch.nn.Linear(8, 10, bias=False), torch.randn(3, 8)   # [V, H], [R, H]
    rows = -(-10 // size)
    padded = torch.cat([head.weight.detach(), torch.zeros(rows * size - 10, 8)])
    mine = torch.nn.Linear(8, rows, bias=False)
    with torch.no_grad():
        mine.weight.copy_(padded[rank * rows:(rank + 1) * rows])
        got = ParallelLMHead(mine, 10, rank, size)(hidden)
        torch.save({'got': got, 'want': head(hidden)}, Path(out_dir) / f'{rank}.pt')
    dist.destroy_process_group()

