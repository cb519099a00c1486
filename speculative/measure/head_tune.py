"""Tuning an MTP head to the model it drafts for: the trunk frozen (run forward only, never copied),
the head distilled to the trunk's own next-token distributions.

At each position p of a window the head sees what it sees when drafting (mtp-reference.md): step 1
takes the next token's embedding and the trunk's post-norm hidden h_p at RoPE position p; step s > 1
takes the token s ahead and the head's own output of step s - 1 at position p + s - 1, attending to the
step-1 rows up to p (the trunk-made rows its cache holds) and to its own chain's earlier steps. Each
step learns the trunk's distribution at p + s by KL divergence to the trunk's top-k probabilities
(renormalized over those k tokens; the head's side is a full softmax): never cross-entropy on sampled
text. A step s > 1 row counts only where the text follows the trunk's greedy choice at the steps before
it: a draft is only ever extended past drafts the model accepted. On the model's own greedy text
(prompts continued first) every row counts.

Trainable state is float32 (head and AdamW moments); the trunk runs at its own precision.

`lm` is a loader.LoadedModel throughout, not imported: loader imports heads, not the reverse.
"""

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..config import SamplingParams, SpecConfig
from ..engine import generate
from ..errors import DynoError
from .corpus import Corpus
from ..heads.mtp import HeadWeights, MTPHead

STATE_WEIGHTS = "state.safetensors"  # head and optimizer state of the last checkpoint
STATE_INFO = "state.json"  # step, settings, loss log
STREAM = "stream.safetensors"  # the token stream trained on (prompts already continued)


@dataclass(frozen=True)
class TuneSettings:
    """How a tune runs; a checkpoint resumes only under the same settings and data."""

    steps: int = 300
    seq_len: int = 256
    batch: int = 0  # windows per step; 0: sized to memory (batch_for)
    lr: float = 3e-4
    warmup: int = 20
    depth: int = 3  # steps the head is unrolled on its own outputs
    top_k: int = 32  # trunk tokens the KL target keeps
    held_out: float = 0.1  # share of windows kept for the acceptance estimate
    continue_tokens: int = 256  # tokens the model writes after each prompt of the data
    continue_temperature: float = 0.0  # 0: greedy continuations
    checkpoint_every: int = 50
    estimate_every: int = 25
    seed: int = 0

    def __post_init__(self):
        checks = [("--steps", self.steps, 1), ("--seq-len", self.seq_len, self.depth + 2), ("--batch", self.batch, 0),
                  ("--depth", self.depth, 1), ("--top-k", self.top_k, 1), ("--continue-tokens", self.continue_tokens, 1),
                  ("--checkpoint-every", self.checkpoint_every, 1), ("--warmup", self.warmup, 0)]
        for flag, value, least in checks:
            if not isinstance(value, int) or value < least:
                raise DynoError(f"{flag} must be a whole number of at least {least}, got {value!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise DynoError(f"--lr must be a positive number, got {self.lr!r}")
        if not 0 < self.held_out < 1:
            raise DynoError(f"--held-out must be between 0 and 1, got {self.held_out!r}")
        if not self.continue_temperature >= 0:
            raise DynoError(f"--continue-temp must be >= 0, got {self.continue_temperature!r}")


@dataclass
class Progress:
    """One optimizer step done: its loss, and the held-out acceptance estimate when one was taken."""

    step: int
    steps: int
    loss: float
    estimate: Optional[List[float]] = None  # per position, teacher-forced on held-out windows


def state_dir(out: Path) -> Path:
    """Where a tune into `out` keeps its checkpoint: beside it, hidden, removed once the head is written."""
    return out.parent / f".{out.name}.tune"


# --- data ----------------------------------------------------------------------------------------------

def token_stream(lm, corpus: Corpus, settings: TuneSettings) -> List[int]:
    """The corpus as one stream of token ids: documents as they are, each prompt followed by what the
    model writes after it (greedy unless continue_temperature; drafting with the starting head, which
    leaves the text unchanged), EOS between them."""
    eos = min(lm.eos_token_ids) if lm.eos_token_ids else 0
    stream: List[int] = []
    for doc in corpus.documents:
        stream += list(doc) + [eos]
    spec = SpecConfig("auto", 3, None)
    for i, prompt in enumerate(corpus.prompts):
        t = settings.continue_temperature
        params = SamplingParams(temperature=t, max_tokens=settings.continue_tokens,
                                seed=settings.seed + i if t else None)
        written = [e.id for e in generate(lm, prompt, params, spec) if hasattr(e, "provenance")]
        stream += list(prompt) + written + ([eos] if not written or written[-1] != eos else [])
    return stream


def windows(stream: Sequence[int], length: int) -> np.ndarray:
    """Non-overlapping windows of `length` tokens [N, length]; the tail shorter than one is dropped."""
    n = len(stream) // length
    return np.asarray(stream[: n * length], dtype=np.int32).reshape(n, length)


def split(wins: np.ndarray, held_out: float) -> Tuple[np.ndarray, np.ndarray]:
    """(train, held-out): the last share of the windows held out, at least one each."""
    if len(wins) < 2:
        raise DynoError(f"the data makes {len(wins)} window(s) of this --seq-len; at least 2 are needed "
                        f"(one to train on, one held out): give more text or a smaller --seq-len")
    k = min(len(wins) - 1, max(1, round(len(wins) * held_out)))
    return wins[:-k], wins[-k:]


def batch_for(lm, settings: TuneSettings, memory: int) -> int:
    """Windows per step that fit a quarter of `memory`: per token, the trunk's logits and the head's at
    each step (logits, softmax and their gradients, float32) dominate."""
    vocab, hidden = lm.target.args.vocab_size, lm.target.args.hidden_size
    per_token = 4 * (vocab * (2 + 4 * settings.depth) + hidden * 64)
    return int(max(1, min(32, memory // 4 // (per_token * settings.seq_len))))


# --- the unrolled head ---------------------------------------------------------------------------------

def chain_mask(chains: int, step: int) -> mx.array:
    """[C, step * C] which keys a step-`step` row of chain p attends to: step-1 rows j <= p (causal), and
    its own chain's rows of steps 2..step (the diagonal of each later block)."""
    eye = mx.eye(chains, dtype=mx.bool_)
    causal = mx.tril(mx.ones((chains, chains), dtype=mx.bool_))
    return mx.concatenate([causal] + [eye] * (step - 1), axis=1)


def _attention_step(attn, y: mx.array, offset: int, kv: List[Tuple[mx.array, mx.array]], mask: mx.array):
    """mlx-lm's Qwen3NextAttention for one step's rows [B, C, H], op for op, its keys and values appended
    to `kv` (this layer's earlier steps) and attended to under `mask`."""
    B, L, _ = y.shape
    queries, gate = mx.split(attn.q_proj(y).reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, L, -1)
    keys = attn.k_norm(attn.k_proj(y).reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = attn.v_proj(y).reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries = attn.rope(attn.q_norm(queries).transpose(0, 2, 1, 3), offset=offset)
    kv.append((attn.rope(keys, offset=offset), values))
    k = mx.concatenate([k for k, _ in kv], axis=2)
    v = mx.concatenate([v for _, v in kv], axis=2)
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate))


def unrolled(head: MTPHead, lm_head, embed: mx.array, hidden: mx.array, depth: int) -> List[mx.array]:
    """The head's logits at steps 1..depth for every chain: `embed` [B, C + depth, H] are the embeddings
    of tokens 1.. of the window, `hidden` [B, C, H] the trunk's post-norm hiddens at 0..C-1."""
    chains = hidden.shape[1]
    kvs = [[] for _ in head.layers]
    out, h = [], hidden
    for s in range(1, depth + 1):
        x = head._fused(embed[:, s - 1 : s - 1 + chains], h)
        mask = chain_mask(chains, s)
        for layer, kv in zip(head.layers, kvs):
            x = x + _attention_step(layer.self_attn, layer.input_layernorm(x), s - 1, kv, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = head.norm(x)
        out.append(lm_head(h).astype(mx.float32))
    return out


@dataclass
class Targets:
    """What the frozen trunk says about a batch of windows, computed once outside the gradient."""

    embed: mx.array  # [B, C + depth, H] float32: embeddings of tokens 1..C + depth
    hidden: mx.array  # [B, C, H] float32: post-norm hiddens at 0..C-1
    top_ids: List[mx.array]  # per step s: [B, C, k] the trunk's top-k tokens at position p + s
    top_logp: List[mx.array]  # per step s: [B, C, k] their log-probabilities renormalized over the k
    greedy: List[mx.array]  # per step s: [B, C] the trunk's greedy token at position p + s
    weight: List[mx.array]  # per step s: [B, C] 1 where drafting reaches step s (text = greedy before it)


def targets(lm, wins: mx.array, depth: int, top_k: int) -> Targets:
    """The trunk's forward over `wins` [B, T] and the per-step targets of its C = T - depth chains."""
    target = lm.target
    T = wins.shape[1]
    chains = T - depth
    h = target.hidden(wins, None)
    logits = target.lm_head(h).astype(mx.float32)  # [B, T, V]
    greedy_all = mx.argmax(logits, axis=-1)  # [B, T]: the trunk's choice for the token after each position
    top_all = mx.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
    top_logits = mx.take_along_axis(logits, top_all, axis=-1)
    logp_all = top_logits - mx.logsumexp(top_logits, axis=-1, keepdims=True)
    follows = (greedy_all[:, :-1] == wins[:, 1:])  # [B, T-1]: the text takes the trunk's greedy token
    ids, logp, greedy, weight = [], [], [], []
    reach = mx.ones((wins.shape[0], chains), dtype=mx.bool_)
    for s in range(1, depth + 1):
        ids.append(top_all[:, s : s + chains])
        logp.append(logp_all[:, s : s + chains])
        greedy.append(greedy_all[:, s : s + chains])
        weight.append(reach.astype(mx.float32))
        if s < depth:  # step s + 1 needs the draft of step s to be the text's token
            reach = reach & follows[:, s : s + chains]
    embed = target.embed(wins[:, 1:]).astype(mx.float32)  # tokens 1..T-1: step s of chain p takes p + s
    out = Targets(embed, h[:, :chains].astype(mx.float32), ids, logp, greedy, weight)
    mx.eval(out.embed, out.hidden, *ids, *logp, *greedy, *weight)
    return out


def take(t: Targets, rows) -> Targets:
    """The windows `rows` of stacked targets."""
    pick = lambda xs: [x[rows] for x in xs]
    return Targets(t.embed[rows], t.hidden[rows], pick(t.top_ids), pick(t.top_logp), pick(t.greedy), pick(t.weight))


def concat(parts: List[Targets]) -> Targets:
    """Targets of several batches as one stack of windows."""
    cat = lambda xs: mx.concatenate(xs, axis=0)
    each = lambda f: [cat([getattr(p, f)[s] for p in parts]) for s in range(len(parts[0].top_ids))]
    return Targets(cat([p.embed for p in parts]), cat([p.hidden for p in parts]), each("top_ids"), each("top_logp"),
                   each("greedy"), each("weight"))


def nbytes(t: Targets) -> int:
    return sum(a.nbytes for a in [t.embed, t.hidden, *t.top_ids, *t.top_logp, *t.greedy, *t.weight])


def head_lm_head(lm, limit: int = 2**31):
    """The trunk's lm_head for the head's logits: a float32 copy of its weight when it is a float matrix
    under `limit` bytes (its gradient then runs through float32 products, on the CPU through BLAS,
    not the slow bfloat16 path), else the trunk's own (quantized: its dequantizing product)."""
    body, args = lm.target.body, lm.target.args
    module = body.embed_tokens if args.tie_word_embeddings else lm.target.text.lm_head
    weight = getattr(module, "weight", None)
    if weight is None or hasattr(module, "scales") or weight.size * 4 > limit:
        return lm.target.lm_head
    weight = weight.astype(mx.float32)
    mx.eval(weight)
    return lambda h: h @ weight.T


def loss_fn(head: MTPHead, lm_head, t: Targets) -> mx.array:
    """Mean over steps of the weighted mean KL(trunk top-k || head) per row."""
    total = mx.array(0.0)
    for s, logits in enumerate(unrolled(head, lm_head, t.embed, t.hidden, len(t.top_ids))):
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl = (mx.exp(t.top_logp[s]) * (t.top_logp[s] - mx.take_along_axis(logq, t.top_ids[s], axis=-1))).sum(-1)
        total = total + (kl * t.weight[s]).sum() / mx.maximum(t.weight[s].sum(), 1.0)
    return total / len(t.top_ids)


def estimate(head: MTPHead, lm_head, t: Targets) -> List[float]:
    """Greedy acceptance by position, teacher-forced: of the chains drafting reaches position s, the share
    whose drafts 1..s are all the trunk's greedy tokens (what a draft/verify round would keep)."""
    ok = None
    rates = []
    for s, logits in enumerate(unrolled(head, lm_head, t.embed, t.hidden, len(t.top_ids))):
        hit = mx.argmax(logits, axis=-1) == t.greedy[s]
        ok = hit if ok is None else ok & hit
        counted = t.weight[-1]  # chains whose text is the trunk's greedy path: each position's truth is known
        rates.append((ok.astype(mx.float32) * counted).sum() / mx.maximum(counted.sum(), 1.0))
    return [float(r) for r in mx.stack(rates).tolist()]


# --- the run -------------------------------------------------------------------------------------------

def training_head(lm) -> MTPHead:
    """A float32 copy of the model's head (the head it was loaded with stays as it is)."""
    if lm.head is None:
        raise DynoError("the model has no MTP head to start from; pass --mtp-head <base>")
    if any(k.endswith(".scales") for k, _ in tree_flatten(lm.head.parameters())):
        raise DynoError(f"the MTP head from {lm.head_source} is quantized; tune a float head "
                        f"(--mtp-head-bits 16, or a head stored in bf16 or float32)")
    head = MTPHead(lm.target.args, num_layers=len(lm.head.layers))
    head.load_weights([(k, v.astype(mx.float32)) for k, v in tree_flatten(lm.head.parameters())], strict=True)
    mx.eval(head.parameters())
    return head


def schedule(settings: TuneSettings):
    """Linear warmup, then cosine decay to a tenth."""
    decay = optim.cosine_decay(settings.lr, max(1, settings.steps - settings.warmup), settings.lr * 0.1)
    if settings.warmup == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(settings.lr / settings.warmup, settings.lr, settings.warmup),
                                 decay], [settings.warmup])


class Tune:
    """One tune: its data, head, optimizer and checkpoint folder; `run()` yields Progress per step."""

    def __init__(self, lm, stream: Sequence[int], settings: TuneSettings, state: Path,
                 signature: dict, memory: int = 2**33):
        self.lm, self.settings, self.state, self.signature = lm, settings, Path(state), signature
        wins = windows(stream, settings.seq_len)
        self.train, self.held = split(wins, settings.held_out)
        self.batch = min(settings.batch or batch_for(lm, settings, memory), len(self.train))  # memory: bytes to size by
        self.head = training_head(lm)
        self.opt = optim.AdamW(learning_rate=schedule(settings), weight_decay=0.0)
        self.opt.init(self.head.trainable_parameters())
        self.step, self.log = 0, []
        self.settled = True  # head, optimizer and step agree (a checkpoint may be taken)
        self.lm_head = head_lm_head(lm)
        self._grad = nn.value_and_grad(self.head, lambda t: loss_fn(self.head, self.lm_head, t))
        self._held_targets = None
        self._cached: Optional[Targets] = None  # every training window's targets, when they fit

    def prepare(self, budget: int) -> Iterator[Tuple[int, int]]:
        """Run the trunk once over every training window and keep its targets, when they fit in `budget`
        bytes: each step then costs the head's work alone. Yields (windows done, windows)."""
        first = targets(self.lm, mx.array(self.train[:1]), self.settings.depth, self.settings.top_k)
        if nbytes(first) * len(self.train) > budget:
            return
        parts = []
        for i in range(0, len(self.train), self.batch):
            parts.append(targets(self.lm, mx.array(self.train[i : i + self.batch]), self.settings.depth,
                                 self.settings.top_k))
            yield min(i + self.batch, len(self.train)), len(self.train)
        self._cached = concat(parts)

    def resume(self) -> bool:
        """Load the checkpoint in the state folder when there is one; False when there is none."""
        info_path = self.state / STATE_INFO
        if not info_path.exists():
            return False
        try:
            info = json.loads(info_path.read_text())
            saved, meta = mx.load(str(self.state / STATE_WEIGHTS), return_metadata=True)
            step = int(meta["step"])
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise DynoError(f"the tune checkpoint in {self.state} cannot be read ({e}); delete it to start over") from None
        if info.get("signature") != self.signature:
            raise DynoError(f"the tune checkpoint in {self.state} was made with other settings or data; rerun "
                            f"with those, or delete it to start over")
        self.head.load_weights([(k[5:], v) for k, v in saved.items() if k.startswith("head.")], strict=True)
        self.opt.state = tree_unflatten([(k[4:], v) for k, v in saved.items() if k.startswith("opt.")])
        self.step, self.log = step, [e for e in info.get("log", []) if e["step"] <= step]
        mx.eval(self.head.parameters(), self.opt.state)
        return True

    def settle(self) -> None:
        """After a stop inside a step: head and optimizer back to where the step began, so they agree with
        self.step (a checkpoint may then be taken)."""
        if not self.settled:
            params, state = self._before
            self.head.update(params)
            self.opt.state = state
            self.settled = True

    def checkpoint(self) -> None:
        """Head, optimizer and step into the state folder, each file written whole then renamed."""
        self.state.mkdir(parents=True, exist_ok=True)
        arrays = {f"head.{k}": v for k, v in tree_flatten(self.head.parameters())}
        arrays.update({f"opt.{k}": v for k, v in tree_flatten(self.opt.state)})
        tmp = self.state / f".{STATE_WEIGHTS}"
        # The step goes with the weights: a stop between the two renames leaves them consistent.
        mx.save_safetensors(str(tmp), arrays, metadata={"step": str(self.step)})
        os.replace(tmp, self.state / STATE_WEIGHTS)
        info = {"signature": self.signature, "step": self.step, "log": self.log}
        _write_text(self.state / STATE_INFO, json.dumps(info, indent=1) + "\n")

    def batch_at(self, step: int) -> np.ndarray:
        """The window indices of `step`: a fixed permutation per pass over the data (seeded), so a resumed run
        sees the batches it would have seen."""
        per_pass = max(1, len(self.train) // self.batch)
        epoch, i = divmod(step, per_pass)
        order = np.random.default_rng([self.settings.seed, epoch]).permutation(len(self.train))
        return np.sort(order[i * self.batch : (i + 1) * self.batch])

    def targets_at(self, step: int) -> Targets:
        rows = self.batch_at(step)
        if self._cached is not None:
            return take(self._cached, mx.array(rows))
        return targets(self.lm, mx.array(self.train[rows]), self.settings.depth, self.settings.top_k)

    def held_out_estimate(self) -> List[float]:
        if self._held_targets is None:
            self._held_targets = targets(self.lm, mx.array(self.held[:max(self.batch, 1) * 4]),
                                         self.settings.depth, self.settings.top_k)
        return estimate(self.head, self.lm_head, self._held_targets)

    def run(self) -> Iterator[Progress]:
        """Optimizer steps from where the checkpoint left off to `steps`, checkpointing as it goes."""
        s = self.settings
        if self.step == 0 and not self.log:  # the starting head's estimate, for the log's first line
            self.log.append({"step": 0, "estimate": [round(e, 4) for e in self.held_out_estimate()]})
        while self.step < s.steps:
            t = self.targets_at(self.step)
            loss, grads = self._grad(t)
            # Arrays are immutable: holding the step's inputs costs no copy, and a stop inside it goes back to them.
            self._before = (self.head.parameters(), tree_map(lambda x: x, self.opt.state))
            self.settled = False  # head and optimizer may be a step ahead of self.step until it is counted
            self.opt.update(self.head, grads)
            mx.eval(loss, self.head.parameters(), self.opt.state)
            self.step += 1
            self.settled = True
            loss = float(loss.item())
            if not math.isfinite(loss):
                raise DynoError(f"the loss became {loss} at step {self.step}; try a smaller --lr")
            est = self.held_out_estimate() if self.step % s.estimate_every == 0 or self.step == s.steps else None
            self.log.append({"step": self.step, "loss": round(loss, 5),
                             **({"estimate": [round(e, 4) for e in est]} if est else {})})
            if self.step % s.checkpoint_every == 0 or self.step == s.steps:
                self.checkpoint()
            yield Progress(self.step, s.steps, loss, est)

    def tensors(self, like: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """The tuned head's tensors in the dtypes of `like` (the starting head's), norms as the module holds
        them (shifted)."""
        return {k: v.astype(like[k].dtype if k in like else v.dtype) for k, v in tree_flatten(self.head.parameters())}


def _write_text(path: Path, text: str) -> None:
    """Write whole then rename, so a reader sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def signature(model: str, head_source: str, corpus: Corpus, settings: TuneSettings) -> dict:
    """What a checkpoint must share with the run that resumes it."""
    return {"model": str(model), "head": str(head_source), "data_sha256": corpus.sha256,
            "settings": asdict(settings)}


def stream_cached(state: Path, sig: dict, make) -> List[int]:
    """The token stream kept in the state folder by an earlier try of the same tune, else made and kept
    (continuing prompts is the slow part of starting)."""
    path = state / STREAM
    key = hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()
    if path.exists():
        try:
            saved = mx.load(str(path), return_metadata=True)
            if saved[1].get("key") == key:
                return saved[0]["ids"].tolist()
        except (OSError, ValueError, RuntimeError):
            pass  # a torn file: made again
    stream = make()
    state.mkdir(parents=True, exist_ok=True)
    tmp = state / f".{STREAM}"
    mx.save_safetensors(str(tmp), {"ids": mx.array(stream, dtype=mx.int32)}, metadata={"key": key})
    os.replace(tmp, path)
    return stream


def finish(state: Path) -> None:
    """The head is written: its checkpoint is no longer needed."""
    shutil.rmtree(state, ignore_errors=True)


def tuned_weights(tune: Tune, like: HeadWeights, source: str) -> HeadWeights:
    """The tuned head as HeadWeights (norms shifted, in the starting head's dtypes)."""
    return HeadWeights(tune.tensors(like.tensors), True, source, {"source": {"via": "dyno head tune"}})


def card(info: dict) -> str:
    """The head folder's README.md: where it came from, on what, and acceptance before and after."""
    lines = ["# MTP head tuned by `dyno head tune`", "",
             f"- model: `{info['model']}`", f"- base head: `{info['base_head']}`",
             f"- data: `{info['data']}` (sha256 {info['data_sha256'][:16]}, {info['tokens']} tokens, "
             f"{info['windows']} windows of {info['settings']['seq_len']})",
             f"- steps: {info['settings']['steps']} x {info['batch']} windows; depth {info['settings']['depth']} "
             f"unrolled; KL to the trunk's top-{info['settings']['top_k']} probabilities; AdamW lr "
             f"{info['settings']['lr']}; prompts continued "
             + ("greedily" if not info['settings']['continue_temperature']
                else f"at temperature {info['settings']['continue_temperature']}"),
             f"- held-out text: `{info['eval_data']}`, {info['eval_prompts']} prompts x {info['eval_tokens']} tokens, "
             f"greedy, depth {info['settings']['depth']}", "",
             "| | tokens per round | acceptance by position |", "|---|---|---|"]
    for when in ("before", "after"):
        r = info[when]
        lines.append(f"| {when} | {r['tokens_per_round']:.3f} | "
                     f"{', '.join(f'{a:.3f}' for a in r['acceptance_by_position'])} |")
    return "\n".join(lines) + "\n"
