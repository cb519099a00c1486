"""Malformed heads never crash loading: `auto` decodes plainly with one notice naming the cause,
`mtp` fails with one DynoError line naming the file and what is wrong."""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from helpers import tiny_models
from helpers.run import dyno
from speculative.errors import DynoError
from speculative.heads.find import cached_head_path
from speculative.loader import load_checkpoint
from speculative.heads.mtp import read_checkpoint_head, write_head_folder

NOTICE = "dyno: decoding without drafts: "
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
WEIGHTS = "mtp.safetensors"


def assert_refused(model, message, **kwargs):
    """`mtp` raises exactly `message`; `auto` loads the model without a head and says so once."""
    with pytest.raises(DynoError) as e:
        load_checkpoint(model, mode="mtp", **kwargs)
    assert e.value.message == message
    lm = load_checkpoint(model, mode="auto", **kwargs)
    assert lm.head is None and lm.target is not None
    assert lm.notices == [NOTICE + message]


def head_folder(model: Path, folder: Path, edit=None) -> Path:
    """A standalone head folder written from `model`'s own head, its tensors edited first."""
    head = read_checkpoint_head(model)
    if edit:
        edit(head.tensors)
    return write_head_folder(folder, head, tiny_models.text_config())


def edit_json(path: Path, edit) -> None:
    """Rewrite a JSON file: `edit` changes the data in place (returns None) or returns new data."""
    data = json.loads(path.read_text())
    new = edit(data)
    path.write_text(json.dumps(data if new is None else new))


def raw_header(path: Path):
    """(header as parsed JSON, the data section) of a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def rewrite(path: Path, header, data: bytes) -> None:
    """A safetensors file with this header (any JSON, however wrong) and data section."""
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


# Each case breaks a good head folder and returns the message both modes must give.
def no_norms_shifted(folder):
    edit_json(folder / "config.json", lambda c: {k: v for k, v in c.items() if k != "norms_shifted"})
    return (f'MTP head config {folder}/config.json lacks "norms_shifted": true or false '
            f"(whether its norm weights include the +1)")


def norms_shifted_as_text(folder):
    edit_json(folder / "config.json", lambda c: c.update(norms_shifted="false"))
    return (f'MTP head config {folder}/config.json lacks "norms_shifted": true or false '
            f"(whether its norm weights include the +1), got 'false'")


def config_is_a_list(folder):
    edit_json(folder / "config.json", lambda c: [c])
    return f'not an MTP head folder ({folder}/config.json has no "format": "dyno-mtp-head")'


def newer_format(folder):
    edit_json(folder / "config.json", lambda c: c.update(format_version=2))
    return f"MTP head config {folder}/config.json has format_version 2; this Dyno reads up to 1 (upgrade Dyno)"


def text_config_not_object(folder):
    edit_json(folder / "config.json", lambda c: c.update(text_config=5))
    return f"MTP head config {folder}/config.json has a text_config that is not a JSON object"


def truncated_data(folder):
    path = folder / WEIGHTS
    header, data = raw_header(path)
    path.write_bytes(path.read_bytes()[:-100])
    first = next(n for n, e in header.items() if n != "__metadata__" and e["data_offsets"][1] > len(data) - 100)
    end = header[first]["data_offsets"][1]
    return (f"safetensors file {path} has a corrupt entry for {first}: data ends at byte {end} of a "
            f"{len(data) - 100}-byte data section (truncated file?)")


def truncated_to_four_bytes(folder):
    path = folder / WEIGHTS
    path.write_bytes(path.read_bytes()[:4])
    return f"safetensors file {path} is truncated or not a safetensors file (4 bytes)"


def huge_header_length(folder):
    path = folder / WEIGHTS
    raw = path.read_bytes()
    path.write_bytes((2**62).to_bytes(8, "little") + raw[8:])
    return (f"safetensors file {path} is truncated or not a safetensors file "
            f"({len(raw)} bytes, header length {2**62})")


def garbage_header(folder):
    path = folder / WEIGHTS
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    path.write_bytes(raw[:8] + b"#" * n + raw[8 + n :])
    return f"safetensors file {path} has a corrupt header: Expecting value: line 1 column 1 (char 0)"


def header_not_an_object(folder):
    path = folder / WEIGHTS
    header, data = raw_header(path)
    rewrite(path, list(header), data)
    return f"safetensors file {path} has a corrupt header: not a JSON object"


def entry_without_offsets(folder):
    path = folder / WEIGHTS
    header, data = raw_header(path)
    del header["mtp.fc.weight"]["data_offsets"]
    rewrite(path, header, data)
    return f"safetensors file {path} has a corrupt entry for mtp.fc.weight: data_offsets None"


def unsupported_dtype(folder):
    path = folder / WEIGHTS
    header, data = raw_header(path)
    header["mtp.fc.weight"]["dtype"] = "F64"
    rewrite(path, header, data)
    return f"cannot read mtp.fc.weight from {path}: unsupported tensor dtype F64"


@pytest.mark.parametrize("breaker", [
    no_norms_shifted, norms_shifted_as_text, config_is_a_list, newer_format, text_config_not_object,
    truncated_data, truncated_to_four_bytes, huge_header_length, garbage_header, header_not_an_object,
    entry_without_offsets, unsupported_dtype,
])
def test_broken_head_folder(tiny_dir, tmp_path, breaker):
    folder = head_folder(tiny_dir(), tmp_path / "head")
    message = breaker(folder)
    assert_refused(tiny_dir(), message, mtp_head=str(folder))


def test_head_tensor_with_integer_dtype(tiny_dir, tmp_path):
    def to_int(t):
        t["fc.weight"] = t["fc.weight"].astype(mx.int32)

    folder = head_folder(tiny_dir(), tmp_path / "head", to_int)
    assert_refused(tiny_dir(), f"MTP head in {folder} has mtp.fc.weight in int32; the model needs a "
                               f"floating-point tensor", mtp_head=str(folder))


def test_head_tensor_with_nan(tiny_dir, tmp_path):
    def poison(t):
        t["layers.0.self_attn.o_proj.weight"][0, 0] = float("nan")

    folder = head_folder(tiny_dir(), tmp_path / "head", poison)
    assert_refused(tiny_dir(), f"MTP head in {folder} has non-finite values (NaN or inf) in "
                               f"mtp.layers.0.self_attn.o_proj.weight: a corrupt file", mtp_head=str(folder))


def test_stray_layer_number(tiny_dir, tmp_path):
    def stray(t):
        t["layers.7.input_layernorm.weight"] = t["layers.0.input_layernorm.weight"]

    folder = head_folder(tiny_dir(), tmp_path / "head", stray)
    assert_refused(tiny_dir(), f"MTP head in {folder} has layers [0, 7], not numbered from 0",
                   mtp_head=str(folder))


def test_moe_head_missing_one_expert(tiny_dir, tmp_path):
    model = tiny_dir("moe-per-expert")
    folder = head_folder(model, tmp_path / "head", lambda t: t.pop("layers.0.mlp.experts.1.up_proj.weight"))
    assert_refused(model, f"MTP head in {folder} has malformed experts: "
                          f"mtp.layers.0.mlp.experts.1.up_proj.weight is missing", mtp_head=str(folder))


def test_moe_head_flat_gate_up(tiny_dir, tmp_path):
    model = tiny_dir("moe-fused")
    name = "layers.0.mlp.experts.gate_up_proj"

    def flatten(t):
        t[name] = t[name].flatten()

    folder = head_folder(model, tmp_path / "head", flatten)
    size = read_checkpoint_head(model).tensors[name].size
    assert_refused(model, f"MTP head in {folder} has malformed experts: mtp.{name} has shape [{size}], "
                          f"not [experts, 2 x intermediate, hidden]", mtp_head=str(folder))


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    return Path(shutil.copytree(tiny_dir(), tmp_path / "model"))


def test_index_puts_head_tensor_in_a_shard_that_lacks_it(model_copy):
    edit_json(model_copy / INDEX, lambda i: i["weight_map"].update({"mtp.fc.weight": SHARDS[0]}))
    assert_refused(model_copy, f"safetensors file {model_copy / SHARDS[0]} has no tensor mtp.fc.weight, "
                               f"which {INDEX} places there")


def test_index_puts_conv1d_in_a_shard_that_lacks_it(model_copy):
    weight_map = json.loads((model_copy / INDEX).read_text())["weight_map"]
    name = next(n for n in weight_map if n.endswith("linear_attn.conv1d.weight"))
    other = SHARDS[1 - SHARDS.index(weight_map[name])]
    edit_json(model_copy / INDEX, lambda i: i["weight_map"].update({name: other}))
    assert_refused(model_copy, f"safetensors file {model_copy / other} has no tensor {name}, "
                               f"which {INDEX} places there")


def test_index_without_a_weight_map_object(model_copy):
    edit_json(model_copy / INDEX, lambda i: i.update(weight_map=list(i["weight_map"])))
    assert_refused(model_copy, f"{model_copy / INDEX} is not a valid safetensors index: "
                               f"weight_map is not tensor name -> file")


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    """The tied-gqa2 trunk without a head, whose card names org/original as its base."""
    folder = tiny_models.build(tmp_path_factory.mktemp("headless") / "m", seed=1, with_head=False)
    (folder / "README.md").write_text("---\nbase_model: org/original\n---\n")
    return folder


def test_broken_cached_head_names_the_fix(tiny_dir, headless, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNO_CACHE", str(tmp_path / "dyno"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = head_folder(tiny_dir(), cached_head_path("org/original"))
    assert load_checkpoint(headless, mode="mtp").head is not None
    (cached / WEIGHTS).write_bytes((cached / WEIGHTS).read_bytes()[:4])
    assert_refused(headless, f"safetensors file {cached / WEIGHTS} is truncated or not a safetensors file "
                             f"(4 bytes); delete {cached} to fetch the head again")
    shutil.rmtree(cached)  # the advice: now it is looked for (and here, offline, not found) afresh
    with pytest.raises(DynoError, match="HF_HUB_OFFLINE=1 prevents downloading it"):
        load_checkpoint(headless, mode="mtp")


def test_head_list_shows_a_broken_cached_head(tiny_dir, tmp_path, monkeypatch, capsys):
    from dyno_ui.cli.heads import cmd_head_list

    monkeypatch.setenv("DYNO_CACHE", str(tmp_path / "dyno"))
    cached = head_folder(tiny_dir(), cached_head_path("org/original"))
    (cached / "config.json").write_text("{not json")
    assert cmd_head_list(argparse.Namespace()) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == "org/original" and row[3] == "unreadable"
    assert " ".join(row[4:]) == f"delete {cached} to fetch it again"


def test_unwritable_cache_is_one_line(tiny_dir, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DynoError) as e:
        head_folder(tiny_dir(), tmp_path / "file" / "mtp" / "org--original")
    assert e.value.message == f"cannot write the MTP head to {tmp_path}/file/mtp/org--original: Not a directory"


def test_cli_broken_head_folder_is_one_error_line(tiny_dir, tmp_path):
    folder = head_folder(tiny_dir(), tmp_path / "head")
    message = no_norms_shifted(folder)
    r = dyno("generate", "--model", str(tiny_dir()), "--prompt", "x", "--max-tokens", "4", "--speculative", "mtp",
             "--mtp-head", str(folder))
    assert r.returncode == 2
    assert r.stderr == f"dyno: error: {message}\n"
    assert r.stdout == ""
