"""The head's precision: the policy, quantizing at load from every source (checkpoint, Dyno cache,
Hugging Face cache, download) with a bf16/float cache, the bytes arithmetic for the 27B shapes, the
report line, the flag's errors, and exactness (greedy equality, distribution) with a quantized head."""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5
from scipy.stats import chi2

from helpers import tiny_models
from helpers.reference import plain_greedy
from dyno_ui import cli
from helpers.fake_hub import FakeHub
from helpers.run import python
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from helpers.drafts import drafted as drafted_run
from speculative.events import Round, Token
from speculative.loader import load_checkpoint
from speculative.heads.mtp import MTPHead
from speculative.heads.precision import (HEAD_BITS, QWEN_27B, HeadMemory, default_head_bits, module_bytes,
                                   planned_bytes, quantize_head)
from speculative.heads.tensors import read_header
from helpers.distribution import FALSE_ALARM, chi_square, exact_joint, sample_tokens

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "assets" / "dyno-tiny"
REPO = "org/original"


# ---- the policy and the arithmetic, no weights ----

def test_default_follows_the_trunk():
    q4 = {"group_size": 64, "bits": 4}
    assert default_head_bits(None, mx.cpu) == default_head_bits(None, mx.gpu) == 16
    assert default_head_bits(q4, mx.gpu) == 8  # Metal/CUDA: the figures
    assert default_head_bits(q4, mx.cpu) == 16  # CPU: its quantized matmul is slower (docs/performance.md)


def lazy_head_bytes(text_config: dict, bits: int, dtype=mx.bfloat16) -> int:
    """The bytes of a head module built with these shapes and quantized: lazy, so nothing is allocated."""
    head = MTPHead(qwen3_5.TextModelArgs.from_dict(text_config))
    head.set_dtype(dtype)
    return module_bytes(quantize_head(head, bits))


@pytest.mark.parametrize("name, config", [
    ("qwen-27b", QWEN_27B),
    ("tiny-moe", tiny_models.text_config(**tiny_models.MOE, model_type="qwen3_5_moe_text")),
])
def test_bytes_arithmetic_matches_a_head_built_with_those_shapes(name, config):
    before = mx.get_active_memory()
    for bits in HEAD_BITS:
        assert planned_bytes(config, bits) == lazy_head_bytes(config, bits), bits
    assert mx.get_active_memory() - before < 2**20  # nothing was materialised
    if name == "qwen-27b":  # the figures in docs/heads.md, Head memory
        assert [planned_bytes(config, b) for b in HEAD_BITS] == [849_398_784, 451_267_584, 238_930_944]


def test_report_line():
    line = HeadMemory(451_267_584, 8, "bfloat16", 64, "Qwen/Qwen3.8-27B@0123abcd").line()
    assert line == "MTP head: 0.45 GB, 8-bit, from Qwen/Qwen3.8-27B@0123abcd"
    lm = load_checkpoint(BUNDLED, head_bits="8")
    assert lm.notices == [f"MTP head: 0.5 MB, 8-bit, from {BUNDLED}"]
    assert lm.head_memory.as_json() == {"bytes": 537_472, "bits": 8, "precision": "8-bit", "group_size": 64,
                                        "source": str(BUNDLED)}
    assert load_checkpoint(BUNDLED).head_memory.line() == f"MTP head: 1.0 MB, bfloat16, from {BUNDLED}"


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x", "--mtp-head-bits", "5"],
    ["serve", "--port", "0", "--mtp-head-bits", "bf16"],
    ["head", "pull", str(BUNDLED), "--mtp-head-bits", "32"],
])
def test_bad_head_bits_is_one_error_line(argv, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err == f"dyno: error: --mtp-head-bits must be 16, 8, 4 or auto, got {argv[-1]!r}\n" and out == ""


# ---- every source, every precision: the same head, bit for bit; the cache stays float ----

def params(head) -> dict:
    return dict(tree_flatten(head.parameters()))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item() for k in a)


def check(lm, bits, reference):
    assert lm.head_memory.bits == bits
    quantized = [p for p, m in lm.head.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(quantized) == (0 if bits == 16 else 8)  # fc, q/k/v/o_proj, gate/up/down_proj
    assert lm.head_memory.bytes == planned_bytes(lm.text_config, bits, itemsize=4)  # the tiny model is float32
    assert same(params(lm.head), reference[bits])


def cache_is_float(folder: Path) -> None:
    header = read_header(folder / "mtp.safetensors")
    assert not any(n.endswith((".scales", ".biases")) for n in header)
    assert {e["dtype"] for e in header.values()} == {"F32"}  # as the original stores it


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """org/original (raw HF, with its head) and a local MLX conversion of it that lost the head."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("precision-repos")
    original = tiny_models.build(root / "original", seed=1)
    (original / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    conversion = root / "conversion"
    convert(hf_path=str(original), mlx_path=str(conversion))
    (conversion / "README.md").write_text(f"---\nbase_model: {REPO}\n---\n")
    reference = {b: params(load_checkpoint(original, mode="mtp", head_bits=b).head) for b in HEAD_BITS}
    return original, conversion, reference


def test_which_layers_are_quantized():
    """Linear layers only; never norms; a MoE head's experts, router and shared-expert gate stay float."""
    kinds = lambda lm: {p: type(m).__name__ for p, m in lm.head.named_modules()  # noqa: E731
                        if p.startswith("fc") or ("proj" in p or "gate" in p or "norm" in p) and "." in p}
    dense = kinds(load_checkpoint(BUNDLED, head_bits=4))
    assert {p for p, k in dense.items() if k == "QuantizedLinear"} == {
        "fc", "layers.0.mlp.down_proj", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj",
        "layers.0.self_attn.k_proj", "layers.0.self_attn.o_proj", "layers.0.self_attn.q_proj",
        "layers.0.self_attn.v_proj"}
    assert {k for p, k in dense.items() if "norm" in p} == {"RMSNorm"}
    moe = kinds(load_checkpoint(ROOT / "assets" / "dyno-tiny-moe", head_bits=4))
    assert {p for p, k in moe.items() if k == "QuantizedLinear"} == {
        "fc", "layers.0.self_attn.k_proj", "layers.0.self_attn.o_proj", "layers.0.self_attn.q_proj",
        "layers.0.self_attn.v_proj", "layers.0.mlp.shared_expert.gate_proj", "layers.0.mlp.shared_expert.up_proj",
        "layers.0.mlp.shared_expert.down_proj"}
    assert {moe[f"layers.0.mlp.switch_mlp.{p}_proj"] for p in ("gate", "up", "down")} == {"SwitchLinear"}
    assert moe["layers.0.mlp.gate"] == moe["layers.0.mlp.shared_expert_gate"] == "Linear"


def test_checkpoint_at_each_precision(repos):
    original, _, reference = repos
    for bits in HEAD_BITS:  # loaded again: the same head, bit for bit (quantizing is deterministic)
        check(load_checkpoint(original, mode="mtp", head_bits=bits), bits, reference)


def test_hf_cache_and_dyno_cache_at_each_precision(repos, tmp_path, monkeypatch):
    from huggingface_hub import constants

    original, conversion, reference = repos
    snapshot = tmp_path / "hf" / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("0" * 40)
    shutil.copytree(original, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for bits in HEAD_BITS:  # extraction, each into a fresh Dyno cache
        monkeypatch.setenv("DYNO_CACHE", str(tmp_path / f"dyno-{bits}"))
        lm = load_checkpoint(conversion, mode="mtp", head_bits=bits)
        folder = tmp_path / f"dyno-{bits}" / "mtp" / REPO.replace("/", "--")
        assert json.loads((folder / "config.json").read_text())["source"]["via"] == "hf-cache"
        check(lm, bits, reference)
        cache_is_float(folder)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))  # only the Dyno cache is left
    for bits in HEAD_BITS:
        lm = load_checkpoint(conversion, mode="mtp", head_bits=bits)
        assert lm.head_source == str(tmp_path / "dyno-4" / "mtp" / REPO.replace("/", "--"))
        check(lm, bits, reference)


DOWNLOAD = """
import json, os, sys
import mlx.core as mx
from mlx.utils import tree_flatten
from dyno_ui.device import device_from_env
from speculative.loader import load_checkpoint
device_from_env()
out = sys.argv[2]
for bits in (16, 8, 4):
    os.environ["DYNO_CACHE"] = os.path.join(out, f"dyno-{bits}")  # a fresh cache: download again
    lm = load_checkpoint(sys.argv[1], mode="mtp", head_bits=bits)
    mx.save_safetensors(os.path.join(out, f"{bits}.safetensors"), dict(tree_flatten(lm.head.parameters())))
    print(json.dumps({"bits": bits, "memory": lm.head_memory.as_json(), "notices": lm.notices}))
"""


def test_download_at_each_precision(repos, tmp_path):
    original, conversion, reference = repos
    with FakeHub() as hub:
        hub.add(REPO, original)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DYNO_")) or k == "DYNO_DEVICE"}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
        r = python("-c", DOWNLOAD, str(conversion), str(tmp_path), env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    for line, bits in zip(r.stdout.splitlines(), HEAD_BITS):
        got = json.loads(line)
        folder = tmp_path / f"dyno-{bits}" / "mtp" / REPO.replace("/", "--")
        assert got["memory"]["bits"] == bits and got["memory"]["source"] == str(folder)
        assert any(n.startswith(f"dyno: fetching the MTP head of {REPO}") for n in got["notices"])
        assert json.loads((folder / "config.json").read_text())["source"]["via"] == "download"
        cache_is_float(folder)
        assert same(mx.load(str(tmp_path / f"{bits}.safetensors")), reference[bits])
        assert got["memory"]["bytes"] == planned_bytes(tiny_models.text_config(), bits, itemsize=4)


# ---- exactness with a quantized head (the bundled model: its trained head drafts well) ----

@pytest.fixture(scope="module")
def bundled_4bit():
    return load_checkpoint(BUNDLED, mode="mtp", head_bits=4)


def test_greedy_equality_with_a_quantized_head(bundled_4bit):
    lm = bundled_4bit
    prompt = lm.tokenizer.encode("def read_lines(path):\n")
    events = list(generate(lm, prompt, SamplingParams(max_tokens=80), SpecConfig("mtp", 3)))
    rounds = [e for e in events if isinstance(e, Round)]
    assert [e.id for e in events if isinstance(e, Token)] == plain_greedy(lm, prompt, 80)
    assert sum(r.accepted for r in rounds) > 0.4 * sum(r.drafted for r in rounds)  # the 4-bit head drafts well


def test_distribution_with_a_quantized_head(bundled_4bit):
    """The first three tokens at T=1, top-k 3, depth 2, against their exact joint (test_distribution)."""
    lm = bundled_4bit
    prompt = lm.tokenizer.encode("def read_lines(path):\n    ")
    joint = exact_joint(lm, prompt)
    counts, drafted, accepted, n = {}, 0, 0, 150
    for seed in range(n):
        spec = drafted_run(lm, SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=seed), 2)
        tokens, d, a = sample_tokens(spec, prompt, 3)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        drafted, accepted = drafted + d, accepted + a
    stat, dof = chi_square(counts, joint, n)
    assert stat < chi2.isf(FALSE_ALARM, dof), (stat, dof)
    assert 0.2 * drafted < accepted < 0.9 * drafted  # both the accept and the residual branch ran
