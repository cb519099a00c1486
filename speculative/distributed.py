"""Dyno across processes: the model split by mlx-lm's own sharding over mx.distributed, drafting on.

- Loading: mlx-lm's pipeline (`model.model.pipeline(group)`) or tensor (`model.shard(group)`)
  parallelism, applied exactly as its `sharded_load` applies them, so plain decoding of the same
  split is mlx-lm's own `sharded_load` + `generate_step` and greedy Dyno output equals it token for
  token. No transport of ours: mlx-lm's collectives inside the model, and one of ours per round.
- Where the head runs: on every rank (replicated). Both splits leave the trunk's final hidden
  state on every rank (pipeline: mlx-lm all-gathers rank 0's output; tensor: every layer ends in an
  all-sum), so each rank drafts the same tokens from the same inputs with no message at all. A head
  on one rank would have to send its drafts to the rank that embeds them before every verify pass:
  a second collective per round, one more link latency on the critical path, to save the head's
  memory (under 2% of a 27B model) on the other ranks; and every rank would no longer evaluate the
  same graph, which collectives punish (tools/distributed_bench.py measures both).
- The round's collective (`Ranks.outcome`): every rank all-gathers its [next token, accepted
  count, drafts]; every rank continues from rank 0's count and tokens, so caches cannot drift
  (a rank whose float rounding differed would still keep what rank 0 decided). Drafts must match
  rank 0's, since the verify pass already embedded them: a mismatch (mixed hardware) is an error.
- Sampling: an unseeded request's random seed is drawn once, on rank 0, and travels with the order
  (`Order.rng_seed`, apart from the request's own `seed`, so it keeps the lossless rule); every rank derives
  the same keys from it and rank 0's acceptance draw is the one every rank keeps, so the draws are
  one process's with that seed (pipeline logits are bit for bit one process's; tensor all-sums
  round differently in the last bits).
- Faults: a lost peer makes MLX raise, which becomes one DistributedError line; a peer that stops
  answering is caught by `Watchdog`, a small process that ends this one with one line on stderr
  when an armed deadline passes: each agreement moves it on by `step_timeout` (a thread would not
  do: the ring backend's init holds the GIL while it waits).
- Serving: rank 0 runs `generate` (it ships each `Order` to the others first); ranks 1..N-1 run
  `follow` until `release`. Every collective must be entered by every rank in the same order, so
  nothing that runs collectives may run on rank 0 alone (a warm-up, a cost-model estimate).
"""

import dataclasses
import json
import os
import random
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream

from . import engine
from .config import SamplingParams, SpecConfig
from .errors import DynoError, one_line
from .events import Done
from .loader import LoadedModel, load_checkpoint, resolve

STRATEGIES = ("pipeline", "tensor")
STEP_TIMEOUT = 60.0  # seconds a rank waits at one step of a generation before it gives up on the others
INIT_TIMEOUT = 120.0  # seconds to reach every rank at start-up (the ring backend retries until then)


class DistributedError(DynoError):
    """The group failed: a rank died, stopped answering or computed something else."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)


# ---- the watchdog ------------------------------------------------------------------------------

# The watcher: reads "SECONDS MESSAGE" (arm) and "-" (disarm) lines; past the deadline it writes
# MESSAGE to the shared stderr, SIGTERMs the watched process and SIGKILLs it `grace` s later.
# End of input (the watched process exited) ends it.
_WATCHER = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, grace = int(sys.argv[1]), float(sys.argv[2])
deadline, message, buf = None, b"", b""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not select.select([0], [], [], wait)[0]:
        os.write(2, message)
        for sig, pause in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
            try:
                os.kill(parent, sig)
            except OSError:
                break
            end = time.monotonic() + pause
            while time.monotonic() < end and select.select([0], [], [], end - time.monotonic())[0]:
                if not os.read(0, 4096):
                    sys.exit(0)
        sys.exit(0)
    data = os.read(0, 4096)
    if not data:
        sys.exit(0)
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        if line == b"-":
            deadline = None
        else:
            seconds, message = line.split(b" ", 1)
            deadline, message = time.monotonic() + float(seconds), message + b"\n"
"""


class Watchdog:
    """Ends this process with one line on stderr when an armed deadline passes.

    A separate small process keeps the time: a rank blocked in a collective may hold the GIL (the
    ring backend's init does), so no thread of this one is sure to wake. On expiry it sends SIGTERM
    (a server shuts down, answering its requests) and SIGKILL `grace` seconds later.
    """

    def __init__(self, grace: float = 5.0):
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCHER, str(os.getpid()), str(grace)],
                                      stdin=subprocess.PIPE, close_fds=True)
        self.armed = False

    def arm(self, seconds: float, message: str) -> None:
        """Set (or move) the deadline to `seconds` from now; `message` is the line written on expiry."""
        line = " ".join(message.split())  # one line, whatever the message held
        self._send(f"{seconds:.3f} {line}\n")
        self.armed = True

    def disarm(self) -> None:
        if self.armed:
            self._send("-\n")
            self.armed = False

    @contextmanager
    def deadline(self, seconds: float, message: str):
        """Arm for the block's duration (the block may move the deadline on; see Ranks.outcome)."""
        self.arm(seconds, message)
        try:
            yield self
        finally:
            self.disarm()

    def close(self) -> None:
        """Stop the watcher (it also stops by itself when this process exits)."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait()

    def _send(self, text: str) -> None:
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
        except OSError:  # the watcher is gone (killed from outside): no deadline, but no crash either
            pass


def error_line(rank: int, what: str) -> str:
    """The one line a rank leaves when the group fails."""
    return f"dyno: error: rank {rank}: {what}"


def init_group(backend: str = "any", timeout: float = INIT_TIMEOUT,
               watchdog: Optional[Watchdog] = None) -> Any:
    """mx.distributed.init(strict), ending the process with one line if the ranks do not all meet
    within `timeout` seconds (the ring backend keeps retrying an unreachable peer)."""
    rank = os.environ.get("MLX_RANK", "?")
    dog = watchdog or Watchdog()
    try:
        with dog.deadline(timeout, error_line(rank, f"could not reach every rank within {timeout:g} s "
                                                    f"(mx.distributed.init, backend {backend})")):
            return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:  # e.g. no hostfile: not launched by mlx.launch
        raise DistributedError(f"cannot join the distributed group ({one_line(e)}); start every rank with "
                               f"mlx.launch, e.g. mlx.launch --hosts host1,host2 -- dyno ... --distributed pipeline") from None
    finally:
        if watchdog is None:
            dog.close()


# ---- loading -----------------------------------------------------------------------------------

def shard(strategy: str, group) -> Any:
    """The mlx-lm call that splits a model across `group` (what sharded_load applies)."""
    if strategy == "tensor":
        return lambda model: model.shard(group)
    if strategy == "pipeline":
        return lambda model: model.model.pipeline(group)
    raise DynoError(f"--distributed must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def check_split(config: dict, strategy: str, n: int) -> None:
    """Tensor parallelism needs every head count and width divisible by the group size (mlx-lm
    would split them unevenly without a word); a pipeline needs a layer per rank."""
    text = config.get("text_config", config)
    if strategy == "pipeline":
        if text.get("num_hidden_layers", 0) < n:
            raise DynoError(f"a pipeline over {n} ranks needs {n} layers; the model has {text.get('num_hidden_layers')}")
        return
    names = ["num_attention_heads", "linear_num_key_heads", "linear_num_value_heads", "intermediate_size",
             "moe_intermediate_size", "shared_expert_intermediate_size"]
    if not text.get("tie_word_embeddings", True):
        names.append("vocab_size")  # an untied lm_head is split by rows
    uneven = [f"{name} {text[name]}" for name in names if text.get(name) and text[name] % n]
    kv = text.get("num_key_value_heads")
    if kv and (kv % n if kv >= n else n % kv):  # fewer KV heads than ranks are repeated, evenly
        uneven.append(f"num_key_value_heads {kv}")
    if uneven:
        raise DynoError(f"tensor parallelism over {n} ranks needs sizes divisible by {n}; "
                        f"this model has {', '.join(uneven)}")


def load_sharded(path, strategy: str, group=None, watchdog: Optional[Watchdog] = None,
                 step_timeout: float = STEP_TIMEOUT, **load_kw) -> LoadedModel:
    """Load `path` split across `group` (default: mx.distributed.init()) with its MTP head on every
    rank; `load_kw` go to loader.load_checkpoint (mode, mtp_head, head_bits, notify, ...)."""
    group = group or mx.distributed.init()
    source = resolve(path, load_kw.get("notify"))  # a repo id: every rank takes it from its own cache, or downloads
    try:
        check_split(json.loads((source.folder / "config.json").read_text()), strategy, group.size())
    except (OSError, ValueError):
        pass  # load_checkpoint names what is wrong with the folder
    lm = load_checkpoint(source.folder, shard=shard(strategy, group), repo_id=source.repo_id, **load_kw)
    lm.ranks = Ranks(group, strategy, watchdog, step_timeout)
    return lm


class Member:
    """This process as one rank of the group `mlx.launch` started (`--distributed`): its watchdog,
    its group, and its part of the model. Rank 0 leads; the others `follow` it."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self.watchdog = Watchdog()
        try:
            self.group = init_group(watchdog=self.watchdog)
        except BaseException:
            self.watchdog.close()
            raise
        self.leader = self.group.rank() == 0

    def load(self, path, **load_kw) -> LoadedModel:
        """This rank's part of `path` (load_kw as for loader.load_checkpoint)."""
        return load_sharded(path, self.strategy, self.group, watchdog=self.watchdog, **load_kw)

    def close(self) -> None:
        self.watchdog.close()


# ---- the round's agreement ---------------------------------------------------------------------

class _Halt(Exception):
    """Rank 0 ended the generation before the engine did (a stop string, a cancel)."""


@dataclass
class Ranks:
    """The processes sharing a model: the collective each round ends with, and its deadline."""

    group: Any
    strategy: str
    watchdog: Optional[Watchdog] = None
    step_timeout: float = STEP_TIMEOUT
    halting: bool = False  # rank 0: the next outcome tells every rank to stop
    rounds: int = 0

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def outcome(self, next_token: mx.array, n_accepted: Optional[mx.array] = None,
                drafts: Optional[mx.array] = None) -> Tuple[int, int, List[int]]:
        """Rank 0's (next token, accepted count, drafts) on every rank: one all_gather of k + 3 ints."""
        parts = [next_token.reshape(1), mx.zeros(1) if n_accepted is None else n_accepted.reshape(1),
                 mx.array([int(self.halting and self.rank == 0)])]
        if drafts is not None:
            parts.append(drafts.reshape(-1))
        row = mx.concatenate([p.astype(mx.int32) for p in parts])
        try:
            rows = mx.distributed.all_gather(row[None], group=self.group).tolist()
        except RuntimeError as e:  # MLX raises when a peer's connection is lost
            raise DistributedError(f"rank {self.rank}: lost the other ranks: {one_line(e)}") from None
        self.rounds += 1
        if self.watchdog is not None and self.watchdog.armed:  # the next step gets a fresh deadline
            self.watchdog.arm(self.step_timeout, self._silence())
        (next_id, accepted, halt, *drafted), *others = rows
        for r, other in enumerate(others, start=1):
            if other[3:] != drafted:
                raise DistributedError(
                    f"rank {r} drafted {other[3:]} where rank 0 drafted {drafted} (round {self.rounds}): "
                    f"ranks must compute alike (the same hardware and MLX build)")
        if halt:
            raise _Halt()
        return next_id, accepted, drafted

    def _silence(self) -> str:
        return error_line(self.rank, f"no answer from the other ranks for {self.step_timeout:g} s "
                                     f"(after round {self.rounds}): a rank died or cannot be reached")

    @contextmanager
    def guarded(self, seconds: float):
        """A generation's deadline: `seconds` to its first agreement (the prefill), then
        step_timeout between agreements; MLX errors on the way become one DistributedError line."""
        dog = self.watchdog
        with (dog.deadline(seconds, self._silence()) if dog else nullcontext()):
            try:
                yield
            except RuntimeError as e:
                raise DistributedError(f"rank {self.rank}: the group failed: {one_line(e)}") from None


# ---- orders: what rank 0 runs, every rank runs ---------------------------------------------------

@dataclass(frozen=True)
class Order:
    """What rank 0 tells every rank to run: one generation (its seed already drawn, on rank 0), or a
    ping or a stop. (Not the server's queued Job: this is what travels between ranks.)"""

    prompt: Tuple[int, ...]
    params: SamplingParams
    spec: SpecConfig = SpecConfig()
    prefill_step: int = engine.PREFILL_STEP
    kind: str = "generate"  # or "ping" (keep followers' idle deadline) or "stop" (followers return)
    # An unseeded request's random seed, drawn on rank 0 so that every rank draws alike. Not the
    # request's `seed`: a seed asks for plain mlx-lm's text (the coupled rule, which accepts less).
    rng_seed: Optional[int] = None

    def encode(self) -> bytes:
        try:
            return json.dumps({"prompt": list(self.prompt), "params": dataclasses.asdict(self.params),
                               "spec": dataclasses.asdict(dataclasses.replace(self.spec, policy=None)),  # each rank's own
                               "prefill_step": self.prefill_step,
                               "kind": self.kind, "rng_seed": self.rng_seed}).encode()
        except TypeError as e:  # a setting that is not plain data cannot travel to the other ranks
            raise DynoError(f"this request cannot be shared across ranks: {one_line(e)}") from None

    @classmethod
    def decode(cls, data: bytes) -> "Order":
        d = json.loads(data)
        params = d["params"]
        if params.get("logit_bias"):
            params["logit_bias"] = tuple(tuple(pair) for pair in params["logit_bias"])
        return cls(tuple(d["prompt"]), SamplingParams(**params), SpecConfig(**d["spec"]), d["prefill_step"],
                   d["kind"], d["rng_seed"])


def order_for(prompt: Sequence[int], params: SamplingParams, spec: SpecConfig, prefill_step: int) -> Order:
    """Rank 0's order for one generation: an unseeded request gets a random seed drawn here."""
    return Order(tuple(prompt), params, spec, prefill_step,
                 rng_seed=random.getrandbits(32) if params.seed is None else None)




def _settle() -> None:
    """Wait for the work still queued on this rank. mlx-lm's generate_step leaves its next step in
    flight on its own stream when a generation ends; collectives from two streams at once pair
    with the wrong partners across ranks (garbage, measured)."""
    mx.synchronize(generation_stream)
    mx.synchronize()


def _broadcast(ranks: Ranks, data: Optional[bytes]) -> bytes:
    """Rank 0's bytes on every rank (two all_sums: the length, then the bytes)."""
    _settle()
    mine = data if ranks.rank == 0 else b""
    n = mx.distributed.all_sum(mx.array([len(mine)], dtype=mx.int32), group=ranks.group).item()
    # int32, not uint8: the ring backend's all_sum garbles uint8 arrays (MLX 0.32.4, measured).
    buf = mx.array(list(mine) or [0] * n, dtype=mx.int32) if ranks.rank == 0 else mx.zeros((n,), mx.int32)
    return bytes(mx.distributed.all_sum(buf, group=ranks.group).tolist())


def share(ranks: Ranks, order: Optional[Order] = None) -> Order:
    """Rank 0 passes its order; every rank gets it back (followers pass nothing)."""
    try:
        return Order.decode(_broadcast(ranks, order.encode() if order is not None else None))
    except RuntimeError as e:
        raise DistributedError(f"rank {ranks.rank}: lost the other ranks: {one_line(e)}") from None


def _prefill_allowance(ranks: Ranks, order: Order) -> float:
    return ranks.step_timeout * (1 + len(order.prompt) // order.prefill_step)


def _run(lm: LoadedModel, order: Order) -> Iterator:
    """The order's events on this rank, under the group's deadline; ends quietly on rank 0's halt."""
    ranks = lm.ranks
    events = engine.generate(lm, list(order.prompt), order.params, order.spec, prefill_step=order.prefill_step,
                             rng_seed=order.rng_seed)
    with ranks.guarded(_prefill_allowance(ranks, order)):
        try:
            yield from events
        except _Halt:
            return


def generate(lm: LoadedModel, prompt: Sequence[int], params: SamplingParams, spec: SpecConfig = SpecConfig(),
             prefill_step: int = engine.PREFILL_STEP) -> Iterator:
    """Rank 0: engine.generate across the group. The order (a random seed drawn here when none is given) goes
    to the followers (`follow`), then every rank runs it; this rank's events come back. Closing the
    stream early (stop string, cancel) runs one more round so that the followers stop with it
    (plain decoding has no agreement to carry that: it runs to EOS or max_tokens). No prefix
    cache: each rank's would evict by its own shard's bytes, and the ranks' caches must match."""
    ranks = lm.ranks
    order = share(ranks, order_for(prompt, params, spec, prefill_step))
    events = _run(lm, order)
    finished = False
    try:
        for event in events:
            yield event
            finished = isinstance(event, Done)
    finally:
        if not finished:
            _halt(ranks, events)


def _halt(ranks: Ranks, events: Iterator) -> None:
    """Pull `events` until every rank has seen rank 0's halt (at the next agreement) or the
    generation ended by itself on every rank (EOS, max_tokens: no agreement is pending)."""
    ranks.halting = True
    try:
        for _ in events:
            pass
    finally:
        ranks.halting = False


def follow(lm: LoadedModel, idle_timeout: Optional[float] = None) -> int:
    """Ranks 1..N-1: run rank 0's orders until it sends "stop"; returns the number of generations.

    With `idle_timeout` (and the Ranks' watchdog), a follower that hears nothing, not even a
    `keepalive`, for that long ends with one line: rank 0 died or hangs.
    """
    ranks = lm.ranks
    done = 0
    while True:
        dog = ranks.watchdog if idle_timeout else None
        with (dog.deadline(idle_timeout, error_line(ranks.rank, f"nothing from rank 0 for {idle_timeout:g} s: "
                                                                "it died or cannot be reached"))
              if dog else nullcontext()):
            order = share(ranks)
        if order.kind == "stop":
            return done
        if order.kind == "generate":
            for _ in _run(lm, order):
                pass
            done += 1


def keepalive(lm: LoadedModel) -> None:
    """Rank 0, while idle: tell the followers it is alive (their idle deadline starts again)."""
    share(lm.ranks, Order((), SamplingParams(), kind="ping"))


def release(lm: LoadedModel) -> None:
    """Rank 0: the followers return from `follow` (at shutdown)."""
    share(lm.ranks, Order((), SamplingParams(), kind="stop"))

