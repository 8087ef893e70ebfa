"""The GPU path's four headline figures, on random Qwen3 weights made on the device (no download).

For Qwen3-0.6B and Qwen3-8B in bfloat16, each with and without async scheduling: batch-1 decode
tok/s (CUDA graphs on, the engine's default on a GPU), for 8B also its share of the HBM roofline
(weight bytes a token reads x tok/s / the device's peak bandwidth), nano-vllm's workload (256
requests, input and output lengths uniform in 100-1024, ignore_eos) and an 8k-token prefill.
The measurements are chapter 18's (petite_llm.bench). `python tools/gpu_check.py OUT [--dry]`
writes OUT/gpu_check.json and prints one PASS/FAIL line per figure; tools/gpu_check.sh runs it.
--dry: the same code on the CPU, at toy sizes, in seconds (make test runs it).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import sys
from pathlib import Path

import torch

from petite_llm.bench.offline import (measure_offline, measure_prefill_decode, memory_read_gb_s,
                                      weight_bytes)
from petite_llm.bench.peers import PetitePeer, make_requests, shape_config
from petite_llm.model.config import ModelConfig
from petite_llm.engine.llm_engine import LLM
from petite_llm.model.qwen3 import Qwen3ForCausalLM
from petite_llm.model.sampling_params import SamplingParams

FULL = dict(device='cuda', shapes=('qwen3-0.6b', 'qwen3-8b'), layers=None, decode_prompt=128,
            decode_tokens=128, requests=256, min_len=100, max_len=1024, prefill_len=8192)
DRY = dict(device='cpu', shapes=('tiny', 'tiny'), layers=2, decode_prompt=8, decode_tokens=32,
           requests=6, min_len=4, max_len=16, prefill_len=64)
# peak HBM bandwidth in bytes/s by the name CUDA reports (vendor data sheets), most specific first
PEAK_BANDWIDTH = [('H200', 4.8e12), ('H100 NVL', 3.9e12), ('H100 PCIe', 2.0e12),
                  ('H100', 3.35e12), ('A100-SXM4-80GB', 2.039e12), ('A100 80GB PCIe', 1.935e12),
                  ('A100', 1.555e12)]


class BuiltPeer(PetitePeer):
    "Chapter 18's PetitePeer on an LLM built here, around a model made on the device."
    def __init__(self, llm: LLM):
        self.SamplingParams, self.llm = SamplingParams, llm


def random_model(shape: str, layers: int | None, device: str) -> Qwen3ForCausalLM:
    "A Qwen3 of a benchmark shape with random bfloat16 weights, made where it will run."
    fields = shape_config(shape, layers)
    fields['eos_token_id'] = [fields['eos_token_id']]
    cfg = ModelConfig(model_type='qwen3', qk_norm=True, **fields)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def peak_bandwidth(device: str) -> tuple[float, str]:
    "Peak memory bandwidth in bytes/s and where it comes from (a data sheet, else measured)."
    if device == 'cuda':
        name = torch.cuda.get_device_name()
        for key, value in PEAK_BANDWIDTH:
            if key in name:
                return value, f'data sheet of {name}'
    return memory_read_gb_s(1 << 26, device=device) * 1e9, 'measured read bandwidth'


def free_memory():
    "Give back what the last engine held before the next one sizes its KV pool."
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_shape(shape: str, opts: dict, with_workload: bool) -> dict:
    "Decode, prefill (and the offline workload) of one shape, without and with async scheduling."
    device, model = opts['device'], random_model(shape, opts['layers'], opts['device'])
    cfg = shape_config(shape, opts['layers'])
    figures = {}
    for async_scheduling in (False, True):
        llm = LLM(model, async_scheduling=async_scheduling)
        peer, res = BuiltPeer(llm), {}
        res['decode_tok_s'] = measure_prefill_decode(
            peer, opts['decode_prompt'], opts['decode_tokens'], cfg['vocab_size'],
            device=device)['decode_tok_s']
        # the best of two prefills: the first also compiles the kernels of its shapes
        res['prefill_ms'] = 1e3 * measure_prefill_decode(
            peer, opts['prefill_len'], 2, cfg['vocab_size'], device=device)['prefill_s']
        if with_workload:
            requests = make_requests(opts['requests'], opts['min_len'], opts['max_len'],
                                     cfg['vocab_size'], seed=0)
            res['offline_tok_s'] = measure_offline(peer, requests, device)['offline_tok_s']
        figures['async' if async_scheduling else 'serial'] = res
        del llm, peer
        free_memory()
    return figures


def report(shape: str, figures: dict) -> bool:
    "Print one PASS/FAIL line per figure of one shape (a finite, positive number passes)."
    ok = True
    for mode, values in figures.items():
        for name, value in values.items():
            good = math.isfinite(value) and value > 0
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} {shape} {mode:6} {name} {value:.4g}", flush=True)
    return ok


def run(out: Path, dry: bool) -> bool:
    "Measure every figure, writing out/gpu_check.json after each shape; True if all are PASS."
    opts = DRY if dry else FULL
    small, large = opts['shapes']
    res = dict(dry=dry, device=torch.cuda.get_device_name() if not dry else 'cpu',
               date=datetime.date.today().isoformat(), torch=torch.__version__,
               triton=importlib.metadata.version('triton'), options=opts)
    out.mkdir(parents=True, exist_ok=True)
    save = lambda: (out / 'gpu_check.json').write_text(json.dumps(res, indent=1))
    res['small'] = measure_shape(small, opts, with_workload=True)
    save()
    ok = report(small, res['small'])
    peak, source = peak_bandwidth(opts['device'])
    bytes_per_token = weight_bytes(shape_config(large, opts['layers']), torch.bfloat16)
    res['roofline'] = dict(peak_bytes_s=peak, source=source, weight_bytes=bytes_per_token)
    res['large'] = measure_shape(large, opts, with_workload=False)
    for figures in res['large'].values():
        figures['roofline_share'] = figures['decode_tok_s'] * bytes_per_token / peak
    save()
    return report(large, res['large']) and ok


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('out', type=Path, help='folder for gpu_check.json')
    parser.add_argument('--dry', action='store_true', help='CPU, toy sizes: the code paths only')
    args = parser.parse_args()
    sys.exit(0 if run(args.out, args.dry) else 1)
