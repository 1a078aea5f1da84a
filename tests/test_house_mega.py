"""The house Mega submission's own pieces, in Triton's interpreter on the CPU: its int4 GEMV against
the reference's dequantise-then-multiply, and one decode step against the reference step (the
grader checks it end to end on the GPU; this keeps its arithmetic honest in CI, in seconds).

They run in a child process with TRITON_INTERPRET=1 from its start: Triton reads the variable when it
decorates its own library functions, so a test process that imported Triton before cannot switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DECK = ROOT / "eval" / "decks" / "mega" / "02_kimi_linear_decode"
HOUSE = ROOT / "data" / "submissions" / "mega" / "20261201_200000_house_kernelboard-house_02_kimi_linear_decode"

CHILD = r'''
import importlib.util, json, sys
import torch, yaml

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

deck, house = sys.argv[1], sys.argv[2]
reference = load("reference", deck + "/reference.py")
solution = load("solution", house + "/solution.py")
found = {}

gen = torch.Generator().manual_seed(3)
experts = reference.QuantExperts(5, 256, 96)
experts.init_random(gen)
x = (torch.randn(256, generator=gen) * 0.25).to(torch.bfloat16)
idx = torch.tensor([3, 0, 3])
got = solution.w4_gemv(x, experts.w_q, experts.scales, experts.zeros, 128, idx)
want = torch.stack([x.float() @ experts.weight_bf(int(e)).float() for e in idx])
found["shared_x"] = [list(got.shape), (got - want).abs().max().item(), want.abs().max().item()]
rows = torch.randn(3, 256, generator=gen)
got = solution.w4_gemv(rows, experts.w_q, experts.scales, experts.zeros, 128, idx)
want = torch.stack([rows[r] @ experts.weight_bf(int(e)).float() for r, e in enumerate(idx)])
found["row_x"] = [list(got.shape), (got - want).abs().max().item(), want.abs().max().item()]

shape = yaml.safe_load(open(deck + "/problem.yaml"))["cpu_shapes"][0]["params"]
cfg = reference.build_config(shape)
ref = reference.Model(cfg)
model = solution.Model(cfg)
model.load_state_dict(ref.state_dict(), strict=True)
hidden, state = reference.init_token(cfg, 0), reference.init_state(cfg, shape["context_len"], 0)
got_h, got_s = model.step(hidden.clone(), reference.clone_state(state))
want_h, want_s = ref.step(hidden.clone(), reference.clone_state(state))
found["cosine"] = torch.nn.functional.cosine_similarity(got_h.float(), want_h.float(), dim=0).item()
found["hidden"] = [(got_h.float() - want_h.float()).abs().max().item(), str(got_h.dtype)]
found["state"] = {f"{i}.{k}": [list(g[k].shape) == list(w[k].shape), str(g[k].dtype) == str(w[k].dtype),
                               (g[k].float() - w[k].float()).abs().max().item()]
                  for i, (g, w) in enumerate(zip(got_s, want_s)) for k in w}
found["state_keys"] = [sorted(g) == sorted(w) for g, w in zip(got_s, want_s)]
print(json.dumps(found))
'''


@pytest.fixture(scope="module")
def found() -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(DECK), str(HOUSE)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_int4_gemv_matches_dequantise_then_multiply(found: dict) -> None:
    for case in ("shared_x", "row_x"):  # one x for every expert (gate, up), one x per row (down)
        shape, diff, scale = found[case]
        assert shape == [3, 96] and diff <= 2e-3 + 1e-2 * scale, (case, diff, scale)


def test_a_house_step_matches_the_reference_step(found: dict) -> None:
    assert found["cosine"] > 0.9999
    diff, dtype = found["hidden"]
    assert diff <= 0.02 and dtype == "torch.bfloat16"
    assert found["state_keys"] == [True] * 4
    for key, (same_shape, same_dtype, diff) in found["state"].items():
        assert same_shape and same_dtype and diff <= 0.02, key
