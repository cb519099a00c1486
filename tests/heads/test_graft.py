"""Grafting: a model that ships no head takes one from another checkpoint of the same architecture
(a folder on disk or a head folder, a full checkpoint with its head embedded), and a head made for
another hidden size or vocabulary is refused in one line naming the mismatch."""

import numpy as np
import pytest
from mlx.utils import tree_flatten

from helpers import tiny_models
from helpers.run import dyno
from speculative.errors import DynoError
from speculative.loader import load_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A donor with its head embedded, a model of the same shape without one, and donors of other shapes."""
    root = tmp_path_factory.mktemp("graft")
    return {
        "donor": tiny_models.build(root / "donor", seed=1),
        "headless": tiny_models.build(root / "headless", seed=2, with_head=False),
        "narrow": tiny_models.build(root / "narrow", seed=3, hidden_size=32),
        "other-vocab": tiny_models.build(root / "other-vocab", seed=3, vocab_size=384),
    }


def _params(lm):
    return {k: np.array(v) for k, v in tree_flatten(lm.head.parameters())}


@pytest.mark.parametrize("flag", ["mtp_base", "mtp_head"])
def test_head_embedded_in_a_checkpoint_is_grafted(models, flag):
    """--mtp-base FOLDER and --mtp-head FOLDER both read the donor's mtp.* tensors in place, shifted
    once, so the grafted head is the donor's own head, tensor for tensor."""
    donor = load_checkpoint(models["donor"], mode="mtp")
    lm = load_checkpoint(models["headless"], mode="mtp", **{flag: str(models["donor"])})
    assert lm.head_source == str(models["donor"])
    want = _params(donor)
    got = _params(lm)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("donor, message", [
    ("narrow", "it was made for a hidden size of 32, the model has 64"),
    ("other-vocab", "it was made for a vocabulary of 384, the model has 320"),
])
@pytest.mark.parametrize("flag", ["mtp_base", "mtp_head"])
def test_a_head_that_does_not_fit_is_refused(models, donor, message, flag):
    with pytest.raises(DynoError) as e:
        load_checkpoint(models["headless"], mode="mtp", **{flag: str(models[donor])})
    assert e.value.message == f"MTP head in {models[donor]} does not fit this model: {message}"


def test_a_base_folder_without_a_head_says_so(models):
    with pytest.raises(DynoError) as e:
        load_checkpoint(models["headless"], mode="mtp", mtp_base=str(models["headless"]))
    assert e.value.message == f"--mtp-base {models['headless']} has no MTP head: its checkpoint holds no mtp.* tensors"


def test_cli_grafts_and_refuses_in_one_line(models):
    ok = dyno("generate", "--model", str(models["headless"]), "--mtp-base", str(models["donor"]),
              "--speculative", "mtp", "--prompt", "x = 1", "--max-tokens", "8", "--draft-depth", "2")
    assert ok.returncode == 0, ok.stderr
    assert "MTP head: " in ok.stderr and f"from {models['donor']}" in ok.stderr
    bad = dyno("generate", "--model", str(models["headless"]), "--mtp-head", str(models["narrow"]),
               "--speculative", "mtp", "--prompt", "x = 1", "--max-tokens", "8")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"dyno: error: MTP head in {models['narrow']} does not fit this model: it was made for a hidden size "
        f"of 32, the model has 64"]
