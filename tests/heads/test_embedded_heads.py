"""Heads in the layouts real repos ship, built from the bundled trained model: MLX conversions that
kept the head with its norms shifted all, none or some of the way (decided against the model at
load), an mxfp4 conversion with per-module overrides, an mlx-vlm drafter repo, the
`model.language_model.mtp.` prefix, FP8 block-scaled originals, and the fallback to the original's
head when the embedded one cannot be built. Greedy output equals plain decoding in every one."""

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers.fake_hub import FakeHub
from helpers.reference import plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Round, Token
from speculative.heads.find import Hub, cached_head_path, download_head
from speculative.heads.norm_decision import describe
from speculative.heads.mtp import ALL_NORMS, read_checkpoint_head, shift_norms, write_head_folder
from speculative.heads.tensors import INDEX, read_header
from speculative.loader import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RAW, MLX = ROOT / "assets" / "dyno-tiny", ROOT / "assets" / "dyno-tiny-mlx"
PROMPT = "def read_lines(path):\n"
N = 24
PLAIN = {}  # plain mlx-lm greedy decoding of PROMPT: the trunk is the same in every test


def run(lm):
    """(greedy tokens, accepted drafts, drafted) of one speculative generation; the tokens must be
    plain decoding's."""
    prompt = lm.tokenizer.encode(PROMPT)
    tokens, accepted, drafted = [], 0, 0
    for e in generate(lm, prompt, SamplingParams(max_tokens=N), SpecConfig("mtp", 2)):
        if isinstance(e, Round):
            accepted, drafted = accepted + e.accepted, drafted + e.drafted
        elif isinstance(e, Token):
            tokens.append(e.id)
    if "tokens" not in PLAIN:
        PLAIN["tokens"] = plain_greedy(lm, prompt, N)
    assert tokens == PLAIN["tokens"]
    return tokens, accepted, drafted


def mlx_with_head(folder: Path, tensors: dict, prefix="mtp.", quantization=None) -> Path:
    """The bundled MLX conversion with `tensors` embedded under `prefix`, in a shard of their own."""
    shutil.copytree(MLX, folder)
    mx.save_safetensors(str(folder / "model-mtp.safetensors"), {prefix + k: v for k, v in tensors.items()})
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"].update({prefix + k: "model-mtp.safetensors" for k in tensors})
    (folder / INDEX).write_text(json.dumps(index))
    if quantization is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization": quantization}))
    return folder


@pytest.fixture(scope="module")
def raw_head():
    return read_checkpoint_head(RAW)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, raw_head):
    """The head-folder case: the bundled head written shifted, passed with --mtp-head."""
    folder = write_head_folder(tmp_path_factory.mktemp("head") / "head", raw_head,
                               json.loads((RAW / "config.json").read_text())["text_config"])
    lm = load_checkpoint(MLX, mode="mtp", mtp_head=str(folder))
    return folder, run(lm)


@pytest.mark.parametrize("mix", [(), ALL_NORMS, ("top",)], ids=["none-shifted", "all-shifted", "top-shifted"])
def test_embedded_head_norm_mixes_draft_as_the_head_folder(tmp_path, raw_head, reference, mix):
    """Groups in `mix` stored shifted, the rest zero-centred: the load decides each, acceptance is
    the head folder's, and the notice names what it found."""
    folder = mlx_with_head(tmp_path / "m", shift_norms(raw_head.tensors, mix))
    lm = load_checkpoint(folder, mode="mtp")
    assert run(lm) == reference[1]
    raw = tuple(g for g in ALL_NORMS if g not in mix)
    assert lm.notices[0].startswith(f"dyno: MTP head in {folder}: norms {describe(raw)}, decided by drafting ")
    assert "too close to call" not in lm.notices[0]
    assert lm.notices[-1].startswith("MTP head: ")


def test_mxfp4_conversion_with_its_head_and_overrides(tmp_path, raw_head, reference):
    """Dense layers in mxfp4 (no biases), one override to affine 8-bit, one `false` (kept bf16)."""
    tensors = shift_norms(raw_head.tensors)
    out = {}
    for name, v in tensors.items():
        path = name[: -len(".weight")]
        if v.ndim != 2 or path == "fc":
            out[name] = v
            continue
        mode, group, bits = ("affine", 64, 8) if path == "layers.0.mlp.down_proj" else ("mxfp4", 32, 4)
        packed = mx.quantize(v, group, bits, mode=mode)
        out.update({f"{path}.weight": packed[0], f"{path}.scales": packed[1]})
        if mode == "affine":
            out[f"{path}.biases"] = packed[2]
    quantization = {"group_size": 32, "bits": 4, "mode": "mxfp4", "mtp.fc": False,
                    "mtp.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8, "mode": "affine"}}
    folder = mlx_with_head(tmp_path / "q", out, quantization=quantization)
    lm = load_checkpoint(folder, mode="mtp")
    modes = {p: (m.mode, m.bits) for p, m in lm.head.named_modules() if hasattr(m, "mode")}
    assert modes["layers.0.mlp.gate_proj"] == ("mxfp4", 4) and modes["layers.0.mlp.down_proj"] == ("affine", 8)
    assert "fc" not in modes
    _, accepted, drafted = run(lm)
    assert accepted >= 0.8 * reference[1][1] and drafted > 0  # 4-bit drafts, still most of them kept


def test_mlx_vlm_drafter_repo_with_bare_keys(tmp_path, raw_head, reference):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp", "num_hidden_layers": 1}))
    mx.save_safetensors(str(folder / "model.safetensors"), shift_norms(raw_head.tensors))
    lm = load_checkpoint(MLX, mode="mtp", mtp_head=str(folder))
    assert lm.head_source == str(folder)
    assert run(lm) == reference[1]


def test_model_language_model_mtp_prefix(tmp_path, reference):
    """A raw checkpoint with its head under model.language_model.mtp.: shifted once, by provenance."""
    folder = tmp_path / "raw"
    shutil.copytree(RAW, folder)
    rename = lambda n: "model.language_model." + n if n.startswith("mtp.") else n  # noqa: E731
    for shard in folder.glob("*.safetensors-*.safetensors"):
        tensors = mx.load(str(shard))
        mx.save_safetensors(str(shard), {rename(k): v for k, v in tensors.items()})
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))
    lm = load_checkpoint(folder, mode="mtp")
    assert lm.head_source == str(folder)
    assert run(lm) == reference[1]


def write_fp8_safetensors(path: Path, tensors: dict) -> None:
    """A safetensors file by hand: MLX cannot write F8_E4M3 (uint8 arrays are stored as such)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.array(arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    meta = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(meta)) + meta + b"".join(blobs))


def test_fp8_original_dequantizes_on_read(tmp_path, raw_head, reference):
    """Qwen's -FP8 layout: F8_E4M3 weights with bf16 `_scale_inv` per 128 x 128 block."""
    folder = tmp_path / "fp8"
    shutil.copytree(RAW, folder)
    tensors, want = {}, {}
    for name, v in raw_head.tensors.items():
        if v.ndim != 2:
            tensors[f"mtp.{name}"] = ("BF16", v)
            continue
        blocks = [-(-d // 128) for d in v.shape]
        pad = mx.pad(v.astype(mx.float32), [(0, b * 128 - d) for b, d in zip(blocks, v.shape)])
        amax = mx.abs(pad.reshape(blocks[0], 128, blocks[1], 128)).max(axis=(1, 3))
        scale = (amax / 448.0).astype(mx.bfloat16)
        full = mx.repeat(mx.repeat(scale.astype(mx.float32), 128, 0), 128, 1)[: v.shape[0], : v.shape[1]]
        tensors[f"mtp.{name}"] = ("F8_E4M3", mx.to_fp8(v.astype(mx.float32) / full))
        tensors[f"mtp.{name}_scale_inv"] = ("BF16", scale)
        want[name] = v
    shard = folder / "model.safetensors-00002-of-00002.safetensors"
    trunk = {k: v for k, v in mx.load(str(shard)).items() if not k.startswith("mtp.")}
    trunk_file = folder / "model.safetensors-00003-of-00003.safetensors"
    mx.save_safetensors(str(trunk_file), trunk)
    write_fp8_safetensors(shard, tensors)
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {k: (shard.name if k.startswith("mtp.") else v if v != shard.name else trunk_file.name)
                           for k, v in index["weight_map"].items()}
    index["weight_map"].update({k: shard.name for k in tensors})
    (folder / INDEX).write_text(json.dumps(index))
    assert read_header(shard)["mtp.fc.weight"]["dtype"] == "F8_E4M3"
    head = read_checkpoint_head(folder)
    assert not any(k.endswith("_scale_inv") for k in head.tensors)
    for name, v in want.items():  # e4m3 keeps 3 mantissa bits: within 1/16 of each value's magnitude
        got = head.tensors[name].astype(mx.float32)
        assert head.tensors[name].dtype == mx.bfloat16
        assert mx.all(mx.abs(got - v.astype(mx.float32)) <= mx.abs(v.astype(mx.float32)) / 16 + 1e-6).item(), name
    lm = load_checkpoint(folder, mode="mtp")
    _, accepted, drafted = run(lm)
    assert drafted > 0 and accepted >= 0.8 * reference[1][1]


def test_broken_embedded_head_falls_back_to_the_originals(tmp_path, raw_head, reference, monkeypatch):
    """An embedded head missing a tensor: a notice, then the original's head (here from the Dyno cache)."""
    tensors = dict(shift_norms(raw_head.tensors))
    del tensors["layers.0.mlp.up_proj.weight"]
    folder = mlx_with_head(tmp_path / "broken", tensors)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DYNO_CACHE", str(cache))
    shutil.copytree(reference[0], cached_head_path("dyno-project/dyno-tiny"))  # README: base_model
    lm = load_checkpoint(folder, mode="mtp")
    assert lm.notices[0] == (f"dyno: the MTP head in {folder} cannot be used: MTP head in {folder} is missing "
                             f"tensors: mtp.layers.0.mlp.up_proj.weight; drafting with the head from "
                             f"{cached_head_path('dyno-project/dyno-tiny')}")
    assert run(lm) == reference[1]


@pytest.fixture
def hub_online(tmp_path, monkeypatch):
    """The stand-in Hub, reached in this process: huggingface_hub read its endpoint at import."""
    from huggingface_hub import constants

    with FakeHub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("DYNO_CACHE", str(tmp_path / "dyno"))
        yield hub


def test_mtp_base_at_an_mlx_repo_that_embeds_a_shifted_head(tmp_path, raw_head, reference, hub_online):
    """--mtp-base at an MLX conversion with its head: its norms are decided, never shifted twice."""
    hub_online.add("org/mlx-with-head", mlx_with_head(tmp_path / "remote", shift_norms(raw_head.tensors)))
    head = download_head("org/mlx-with-head", Hub(lambda m: None))
    assert head.norms_shifted is None and head.provenance["raw_hf"] is False
    model = tmp_path / "model"
    shutil.copytree(MLX, model)
    lm = load_checkpoint(model, mode="mtp", mtp_base="org/mlx-with-head")
    assert "norms stored shifted (all seven)" in lm.notices[-2]
    assert run(lm) == reference[1]
    assert json.loads((cached_head_path("org/mlx-with-head") / "config.json").read_text())["norms_shifted"] is None
