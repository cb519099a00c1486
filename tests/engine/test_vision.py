"""Images in the prompt: a tiny Qwen3.5-VL checkpoint loads in mlx-vlm and in Dyno, Dyno's positions
and prompt logits are mlx-vlm's, and greedy decoding with an image drafts exactly (rollback included).
Tests on the checkpoint (`vl_dir`) skip without mlx-vlm; the others run either way."""

import random

import mlx.core as mx
import pytest

from helpers import vision_models
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.round.drafter import HeadDrafter
from speculative.errors import DynoError
from speculative.events import Round, Token
from speculative.loader import load_checkpoint
from speculative.loader.vision import image_prompt

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
WIDTH, HEIGHT = 64, 96  # a 12 x 8 patch grid: 24 rows over 12 positions, rope delta -18


@pytest.fixture(scope="module")
def vl(vl_dir):
    return vl_dir, load_checkpoint(vl_dir)


@pytest.fixture(scope="module")
def reference(vl):
    """mlx-vlm's own load of the checkpoint: its inputs, positions and prompt logits for the image."""
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(str(vl[0]))
    path = vl[0] / "image.png"
    path.write_bytes(vision_models.png(WIDTH, HEIGHT))
    inputs = prepare_inputs(processor, images=[str(path)], prompts=[PROMPT])
    ids = inputs["input_ids"]
    features = model.get_input_embeddings(ids, inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    logits = model.language_model(ids, inputs_embeds=features.inputs_embeds, position_ids=features.position_ids).logits
    return dict(ids=ids[0].tolist(), positions=features.position_ids[:, 0], delta=features.rope_deltas.item(),
                logits=logits[0])


def test_positions_rope_delta_and_prompt_logits_are_mlx_vlms(vl, reference):
    _, lm = vl
    ids, vision = image_prompt(lm.target, lm.vision, lm.tokenizer.encode(PROMPT), [vision_models.png(WIDTH, HEIGHT)])
    assert ids == reference["ids"]
    assert vision.rope.delta == reference["delta"] == -18
    assert mx.array_equal(vision.rope.prompt, reference["positions"]).item()
    logits = lm.target.positioned(vision.rope)(mx.array(ids)[None], lm.target.make_cache(), vision.embeddings)[0]
    assert mx.max(mx.abs(logits - reference["logits"])).item() < 1e-3
    # The trap: sequential positions give the same embeddings plausible logits, far from the model's.
    sequential = lm.target.lm_head(lm.target.hidden(mx.array(ids)[None], lm.target.make_cache(), vision.embeddings))[0]
    assert mx.max(mx.abs(sequential - reference["logits"])).item() > 1e-2


class CoinDrafter(HeadDrafter):
    """The real head drafts (its rows at the image's positions), then each draft is made plain greedy's
    own token or a wrong one by a seeded coin: rounds keep some drafts and roll back the rest."""

    def __init__(self, reference, vocab):
        super().__init__()
        self.reference, self.vocab, self.rng, self.kept = reference, vocab, random.Random(0), []

    def propose(self, rounds, budgets):
        drafts = super().propose(rounds, budgets)  # (computed, then replaced: the head's rows still run)
        (row,), (k,) = rounds.rows, budgets
        start = len(row.generated)
        ref = (self.reference + [0] * k)[start:start + k]
        flags = [self.rng.random() < 0.6 for _ in ref]
        self.kept.append(next((i for i, ok in enumerate(flags) if not ok), k))
        mx.eval(drafts.tokens)
        return drafts._replace(tokens=mx.array([[t if ok else (t + 1) % self.vocab for t, ok in zip(ref, flags)]]))


def tokens(events):
    return [e.id for e in events if isinstance(e, Token)]


def test_greedy_with_an_image_drafts_exactly_at_every_depth(vl):
    _, lm = vl
    ids, vision = image_prompt(lm.target, lm.vision, lm.tokenizer.encode(PROMPT), [vision_models.png(WIDTH, HEIGHT)])
    params = SamplingParams(max_tokens=48)
    plain = tokens(generate(lm, ids, params, SpecConfig(mode="off"), vision=vision))
    assert len(plain) == 48
    for depth in (1, 2, 3):
        coin = CoinDrafter(plain, lm.vocab_size)
        out = tokens(generate(lm, ids, params, SpecConfig(mode="mtp", draft_depth=depth), drafter=coin, vision=vision))
        assert out == plain, depth
        assert 0 in coin.kept and depth in coin.kept  # drafts rejected (rollback) and all kept
    # The head's own drafts under auto, as a user runs it.
    events = list(generate(lm, ids, params, SpecConfig(mode="auto", draft_depth=2), vision=vision))
    assert tokens(events) == plain
    assert any(isinstance(e, Round) for e in events)


def test_a_model_without_a_tower_says_to_use_a_vision_language_conversion(tiny_lm):
    lm = tiny_lm()
    assert lm.vision is None
    assert "has no vision tower" in lm.vision_error and "vision-language conversion" in lm.vision_error


def test_bad_images_are_one_line_errors(vl):
    _, lm = vl
    prompt = lm.tokenizer.encode(PROMPT)
    with pytest.raises(DynoError, match="image 1 cannot be decoded"):
        image_prompt(lm.target, lm.vision, prompt, [b"not an image"])
    with pytest.raises(DynoError, match="1 image placeholders for 2 images"):
        image_prompt(lm.target, lm.vision, prompt, [vision_models.png(32, 32)] * 2)


@pytest.mark.e2e
def test_dyno_generate_image_drafts_the_plain_answer_and_a_bad_image_exits_2(vl, tmp_path, capsys):
    """`dyno generate --image` as a user runs it (one subprocess), and a bad image's one line (in process)."""
    import json

    from dyno_ui.cli import main
    from helpers.run import dyno
    from speculative.loader.vision import images_for

    folder, lm = vl
    image = tmp_path / "image.png"
    image.write_bytes(vision_models.png(WIDTH, HEIGHT))
    prompt = lm.tokenizer.encode("<|vision_start|><|image_pad|><|vision_end|>" + "What is this?")
    ids, vision = images_for(lm, prompt, [image.read_bytes()])
    plain = tokens(generate(lm, ids, SamplingParams(max_tokens=40), SpecConfig(mode="off"), vision=vision))
    r = dyno("generate", "--model", str(folder), "--prompt", "What is this?", "--image", str(image), "--json",
             "--speculative", "mtp", "--draft-depth", "2", "--max-tokens", "40")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == plain
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert main(["generate", "--model", str(folder), "--prompt", "x", "--image", str(bad)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "dyno: error: image 1 cannot be decoded: not a PNG, JPEG, WebP or GIF image"


def test_a_tower_without_mlx_vlm_names_the_install(tmp_path, monkeypatch):
    """Runs without mlx-vlm too: the check comes before mlx-vlm is imported."""
    import json
    import sys

    from speculative.loader.vision import load_vision

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(vision_models.PREPROCESSOR))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"model.visual.patch_embed.proj.weight": mx.zeros((2,))})
    for name in [m for m in sys.modules if m.split(".")[0] == "mlx_vlm"] + ["mlx_vlm"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    assert load_vision(tmp_path, {"vision_config": {}}) == (None, "images need mlx-vlm: pip install 'dyno-mlx[vision]'")


def decoded(decoding, requests, later=(), after=2):
    """Each request's tokens through `decoding`: `requests` join at once, `later` after `after` rounds."""
    out = {r.row_id: [] for r in list(requests) + list(later)}

    def take(events):
        for row_id, o in events.items():
            assert o.error is None, o.error
            out[row_id] += tokens(o.events)
            if o.finish is not None:
                decoding.finish(row_id, len(out[row_id]), o.finish)

    for joined in decoding.join(list(requests)):
        take(joined)
    rounds = 0
    while len(decoding) or later:
        if rounds == after and later:
            for joined in decoding.join(list(later)):
                take(joined)
            later = ()
        if len(decoding):
            take(decoding.step())
        rounds += 1
    return out


def test_an_image_row_beside_text_rows_equals_each_request_decoded_alone(vl):
    """One batch: an image prompt and two text prompts (one joining while the image row decodes),
    greedy and seeded sampled; each row's tokens are the ones it gets decoded alone."""
    from speculative.batched.decoding import Decoding, Request

    _, lm = vl
    ids, vision = image_prompt(lm.target, lm.vision, lm.tokenizer.encode(PROMPT), [vision_models.png(WIDTH, HEIGHT)])
    text = lm.tokenizer.encode("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n")
    spec = SpecConfig("mtp", draft_depth=2)
    greedy, seeded = SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    rows = {"image": (ids, greedy, vision), "text": (text, seeded, None), "late": (text[:-3] + text[-2:], greedy, None),
            "image-seeded": (ids, seeded, vision)}
    alone = {name: tokens(generate(lm, p, params, spec, vision=v)) for name, (p, params, v) in rows.items()}
    assert alone["image"] != alone["late"]  # the rows differ: a mix-up would show
    requests = [Request(name, p, params, vision=v) for name, (p, params, v) in rows.items() if name != "late"]
    late = [Request("late", rows["late"][0], greedy)]
    together = decoded(Decoding(lm, spec, keep_prompts=False), requests, late)
    assert together == alone
