"""The draft vocabulary's ranking: tokens ordered by the probability mass the model itself puts on
them while it writes (docs/heads.md, Draft vocabulary).

Measured on the bundled dyno-tiny (`python tools/draft_vocab.py --rankings`): this ranking keeps the
trunk's next token inside a subset of N tokens more often than the tokenizer's id (merge) order at
every N tried, by far at small N (the first 256 ids of a byte-level BPE are single bytes, most rare).

How: RAW_SEEDS (openings of code and prose) and CHAT_SEEDS (user turns, when the tokenizer has a
chat template) are continued together in one batch (mlx-lm's BatchGenerator), sampling at
temperature 1 from a fixed key, and the model's softmax row at every generated position is summed.
The sums rank the tokens, most first, lower id first on ties.

Once per model: a checkpoint may ship its ranking beside its head (<model>/draft_vocab.safetensors:
the bundled dyno-tiny does, `python tools/draft_vocab.py --ship`). Dyno never writes into a model
folder: it stores what it derives beside the cached head (<cache>/mtp/<org>--<name>/draft_vocab.safetensors)
when the head came from Dyno's cache, else as <cache>/draft-vocab/<trunk fingerprint>.safetensors,
written to a temporary name and renamed. A file that cannot be used is ranked again after a one-line
notice. When ranking fails, or the model is split across processes (every rank must draft from the
same subset, and a file on one machine says nothing of the others'), the id order is used.
"""

import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np

from ..errors import DynoError, one_line
from ..heads.find import dyno_cache_dir, cached_heads_dir

FILE = "draft_vocab.safetensors"
FORMAT, VERSION = "dyno-draft-vocab", "1"
METHOD = "softmax mass of the model's own continuations (T=1)"
TOKENS_PER_SEED = 256  # measured: coverage still grew from 32 to 256 (tools/draft_vocab.py --rankings)
SEED_KEY = 0
RAW_SEEDS = ("import ", "from ", "def ", "class ", "# ", '"""', "    return ", "if __name__ == ",
             "function ", "const ", "#include <", "SELECT ", "$ ", "The ", "In this ", "1. ")
CHAT_SEEDS = ("Hello!", "Write a function that sorts a list of numbers.", "Explain how a hash table works.",
              "Fix this code:\n\nfor i in range(10)\n    print(i)")

Notify = Callable[[str], None]
_ranked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> Ranking


@dataclass(frozen=True)
class Ranking:
    """Token ids, most likely first, and the mass each id got (None: the id order, nothing counted)."""

    order: np.ndarray  # [V] int64, a permutation of range(V)
    mass: Optional[np.ndarray]  # [V] float64 by token id, or None
    source: str  # the file it came from (or was stored in), or "id order"

    def covered(self, n: int) -> Optional[float]:
        """Share of the counted mass on the first n tokens (None without counts)."""
        return float(self.mass[self.order[:n]].sum() / self.mass.sum()) if self.mass is not None else None


def id_order(vocab: int) -> Ranking:
    """The tokenizer's id order: in a byte-level BPE the earliest merges (the most frequent pairs) first."""
    return Ranking(np.arange(vocab), None, "id order")


def ranking(lm, notify: Optional[Notify] = None) -> Ranking:
    """This model's ranking: in memory, else stored, else derived (and stored). Notices go to `notify`,
    else to lm.notices."""
    found = _ranked.get(lm.target)
    if found is None:
        found = _ranked[lm.target] = _find(lm, notify or lm.notices.append)
    return found


def ranking_path(lm) -> Path:
    """Beside the head when it came from Dyno's cache, else in the cache under the trunk's fingerprint."""
    source = Path(lm.head_source) if lm.head_source else None
    if source is not None and source.parent.resolve() == cached_heads_dir().resolve():
        return source / FILE
    from ..prompt_cache.disk import fingerprint  # the prompt cache's: another quantization hashes differently

    return dyno_cache_dir() / "draft-vocab" / f"{fingerprint(lm.config, lm.model)[:32]}.safetensors"


def _find(lm, notify: Notify) -> Ranking:
    vocab = lm.target.args.vocab_size
    if lm.ranks is not None:
        return id_order(vocab)
    path = ranking_path(lm)
    why = ""
    for found in (lm.path / FILE, path):  # shipped with the checkpoint (never written), then Dyno's own
        if found.exists():
            try:
                return load(found, vocab)
            except DynoError as e:
                why = f"{found} is unusable ({e.message}); "
    seeds = seed_prompts(lm.tokenizer)
    notify(f"dyno: draft vocabulary: {why}ranking it by this model's own outputs "
           f"({len(seeds)} continuations of {TOKENS_PER_SEED} tokens, once)")
    try:
        order, mass = derive(lm.model, seeds, vocab, sorted(lm.eos_token_ids))
    except Exception as e:  # the ranking only makes drafts cheaper: failing must cost that, not the run
        notify(f"dyno: draft vocabulary: cannot rank it ({one_line(e)}); using the tokenizer's id order")
        return id_order(vocab)
    try:
        save(path, order, mass)
    except OSError as e:
        notify(f"dyno: draft vocabulary: cannot store {path} ({e.strerror or e}); ranked for this run only")
    return Ranking(order, mass, str(path))


def seed_prompts(tokenizer) -> List[List[int]]:
    """What the model is asked to continue: RAW_SEEDS, and CHAT_SEEDS as user turns when it chats."""
    seeds = [tokenizer.encode(s) for s in RAW_SEEDS]
    if getattr(tokenizer, "chat_template", None):
        seeds += [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                tokenize=True) for c in CHAT_SEEDS]
    return [s for s in seeds if s]


def derive(model, seeds: List[List[int]], vocab: int, eos: List[int], tokens: int = TOKENS_PER_SEED):
    """(order, mass): the summed softmax rows of `seeds`' sampled continuations, and the ids by that sum.

    One batch: on a large model a step of many rows costs about what a step of one does.
    """
    from mlx_lm.generate import BatchGenerator

    key = [mx.random.key(SEED_KEY)]

    def sample(logprobs):  # a key of its own, not the process's: deterministic, and leaves the caller's alone
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs, key=sub)

    batch = BatchGenerator(model, sampler=sample, stop_tokens=[[t] for t in eos],
                           completion_batch_size=len(seeds), prefill_batch_size=len(seeds))
    mass = mx.zeros((vocab,), dtype=mx.float32)
    try:
        batch.insert(seeds, max_tokens=[tokens] * len(seeds))
        while responses := batch.next_generated():
            rows = mx.stack([r.logprobs.reshape(-1)[:vocab] for r in responses])
            mass = mass + mx.exp(rows.astype(mx.float32)).sum(axis=0)
            mx.eval(mass)
    finally:
        batch.close()
    mass = np.array(mass, dtype=np.float64)
    return np.lexsort((np.arange(vocab), -mass)), mass


def save(path: Path, order: np.ndarray, mass: np.ndarray) -> None:
    """Write the ranking atomically: a temporary file in the same folder, then os.replace."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.stem}.{uuid.uuid4().hex}.tmp"  # a plain new file: the umask's permissions
    try:
        save_file({"order": order.astype(np.int32), "mass": mass.astype(np.float32)}, str(tmp),
                  metadata={"format": FORMAT, "version": VERSION, "vocab_size": str(len(order)), "method": METHOD,
                            "tokens_per_seed": str(TOKENS_PER_SEED)})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load(path: Path, vocab: int) -> Ranking:
    """A stored ranking, checked against this vocabulary; DynoError saying what is wrong otherwise."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
            order, mass = f.get_tensor("order"), f.get_tensor("mass")
    except Exception as e:  # safetensors raises its own errors, OSError and others on damaged files
        raise DynoError(f"not a readable ranking: {one_line(e)}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DynoError(f"not a {FORMAT} file of version {VERSION}")
    if meta.get("vocab_size") != str(vocab) or order.shape != (vocab,) or mass.shape != (vocab,):
        raise DynoError(f"made for a vocabulary of {meta.get('vocab_size')}, the model has {vocab}")
    if not np.array_equal(np.sort(order), np.arange(vocab)):
        raise DynoError("its order is not a permutation of the vocabulary")
    if not (np.all(np.isfinite(mass)) and mass.min() >= 0 and mass.sum() > 0):
        raise DynoError("its masses are not finite, non-negative and not all zero")
    return Ranking(order.astype(np.int64), mass.astype(np.float64), str(path))
