"""What the image variant of the chi-square test can see: its samples (the engine's, at the test's
sizes) scored against the right joint and against the joints of three wrong image paths, as an engine
with that error would be scored against the right one.

    python tools/image_chi_square_power.py

Needs mlx-vlm (the tests' tiny Qwen3.5-VL checkpoint). Counts, not times: the figures do not depend
on the machine's load.
"""

import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from scipy.stats import chi2  # noqa: E402

from engine.test_distribution import IMAGE_SAMPLES, VL_PROMPT, ImageShadowDrafter  # noqa: E402
from helpers import vision_models  # noqa: E402
from helpers.drafts import drafted  # noqa: E402
from helpers.distribution import (FALSE_ALARM, PARAMS, chi_square, exact_joint, image_target_dist,  # noqa: E402
                                  mlx_lm_probs, sample_tokens)
from speculative.config import SamplingParams  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.loader.vision import image_prompt  # noqa: E402
from speculative.target import MRoPE  # noqa: E402


def wrong_dist(lm, vision, rope, image_rows):
    """A next-token distribution with the image prompt's rows `image_rows` and positions `rope` (None: sequential)."""
    def dist(lm, tokens):
        n = vision.embeddings.shape[1]
        rows = image_rows if len(tokens) == n else mx.concatenate(
            [image_rows, lm.target.embed(mx.array(tokens[n:])[None])], axis=1)
        hidden = lm.target.hidden(mx.array(tokens)[None], lm.target.make_cache(), rows, rope)
        return np.array(mlx_lm_probs(lm.target.lm_head(hidden)[:, -1], PARAMS)[0])
    return dist


def main() -> None:
    lm = load_checkpoint(vision_models.build(Path(tempfile.mkdtemp())))
    prompt, vision = image_prompt(lm.target, lm.vision, lm.tokenizer.encode(VL_PROMPT), [vision_models.png(32, 32)])
    joints = {"right": exact_joint(lm, prompt, lambda lm, t: image_target_dist(lm, vision, t))}
    wrongs = {"sequential positions": wrong_dist(lm, vision, None, vision.embeddings),
              "no delta after the prompt": wrong_dist(lm, vision, MRoPE(vision.rope.rotary, vision.rope.prompt, 0),
                                                      vision.embeddings),
              "image left out (pad embeddings)": wrong_dist(lm, vision, vision.rope,
                                                            lm.target.embed(mx.array(prompt)[None]))}
    joints.update({name: exact_joint(lm, prompt, dist) for name, dist in wrongs.items()})
    for drafter in ("shadow", "mtp-head"):
        n, counts = IMAGE_SAMPLES[drafter], {}
        for seed in range(n):  # as the test draws them
            random.seed(seed)
            spec = drafted(lm, SamplingParams(temperature=1.0, top_k=3, max_tokens=3), 2,
                           drafter=ImageShadowDrafter(lm, vision) if drafter == "shadow" else None)
            tokens, _, _ = sample_tokens(spec, prompt, 3, vision)
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        for name, joint in joints.items():
            try:
                stat, dof = chi_square(counts, joint, n)
                print(f"{drafter} ({n} samples) against {name}: chi-square {stat:.1f} on {dof} dof, "
                      f"critical {chi2.isf(FALSE_ALARM, dof):.1f}")
            except AssertionError as e:  # mass where that joint puts almost none
                print(f"{drafter} ({n} samples) against {name}: fails at once ({e})")


if __name__ == "__main__":
    main()
