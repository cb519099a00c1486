"""Dyno split across 2 processes (mx.distributed, ring backend on 127.0.0.1), as mlx-lm splits models.

- Greedy output equals mlx-lm's own plain decoding of the same split (its sharded_load +
  generate_step), token for token, for pipeline and tensor parallelism, at depths 1 and 3, dense
  and mixture-of-experts; each round keeps exactly the drafts greedy agrees with.
- Sampled output with a seed equals one process's Dyno output with that seed (whose distribution
  test_distribution.py checks), for both splits.
- A rank that dies, stops answering or never comes up ends the others with one line, in bounded time.

The heads are "copy heads" (drafting the trunk's own last prediction again), so that drafts are
accepted in runs of repeated tokens and rejected elsewhere: every acceptance count from 0 to the
depth occurs, and the rollback runs on each rank's slice of the Gated DeltaNet state.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from helpers import tiny_models
from helpers.run import LAUNCH, free_ports, idle_stdin
from helpers.tools import load_tool
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from dyno_ui.paths import BUNDLED_MODEL
from speculative.errors import DynoError
from speculative.events import Token
from speculative.loader import load_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
RANK = ROOT / "tests" / "helpers" / "distributed_rank.py"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
TOKENS = 28
SAMPLED = {"temperature": 1.0, "top_k": 40, "seed": 11}
UNSEEDED = {"temperature": 1.0, "top_k": 40}  # rank 0 draws its random seed: the ranks must still agree
# Head counts divide by 2 (attention 4, GDN keys 2 and values 4; KV heads repeat); seeds whose
# greedy text has runs of repeated tokens of many lengths.
MODELS = {
    "dense": dict(seed=7),
    "moe": dict(seed=7, moe=True),
    "untied": dict(seed=10, tie_word_embeddings=False, num_key_value_heads=4),  # lm_head split by rows
}


def copy_head(folder: Path) -> None:
    """Make the checkpoint's MTP head draft the trunk's own prediction again: fc keeps the hidden
    half, the attention and MLP outputs are zeroed (the residual passes through), unit norms."""
    shard = folder / "model-00002-of-00002.safetensors"
    w = mx.load(str(shard))
    h = w["mtp.fc.weight"].shape[0]
    w["mtp.fc.weight"] = mx.concatenate([mx.zeros((h, h)), mx.eye(h)], axis=1)
    for k in list(w):
        if k.startswith("mtp.") and ("o_proj" in k or "down_proj" in k):
            w[k] = mx.zeros_like(w[k])
    for k in ("mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        w[k] = mx.zeros_like(w[k])  # zero-centred in the raw layout: a weight of 1
    mx.save_safetensors(str(shard), w, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}
    for name, cfg in MODELS.items():
        built[name] = tiny_models.build(tmp_path_factory.mktemp(f"dist-{name}"), **cfg)
        if name != "untied":  # the untied one keeps its random head: nothing accepted, all rolled back
            copy_head(built[name])
    return built


def plan_file(tmp_path: Path, cases: list, fault: dict = None) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"cases": cases, "fault": fault}))
    return path


def case(models, model: str, strategy: str, **extra) -> dict:
    return dict(name=f"{model}-{strategy}", model=str(models[model]), strategy=strategy, prompt=PROMPT,
                max_tokens=TOKENS, **extra)


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory):
    """One mlx.launch of 2 ranks running every case; rank 0's results by case name."""
    tmp = tmp_path_factory.mktemp("dist-run")
    sampled = [{"depth": 3, "params": SAMPLED}, {"depth": 3, "params": UNSEEDED}]
    cases = [case(models, m, s, depths=[1, 3], **(dict(sampled=sampled, stop_after=5) if m == "dense" else {}))
             for m in ("dense", "moe") for s in ("pipeline", "tensor")]
    cases.append(case(models, "untied", "tensor", depths=[3]))
    out = tmp / "out.json"
    cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "--starting-port",
           str(free_ports()), sys.executable, str(RANK), "--plan", str(plan_file(tmp, cases)), "--out", str(out),
           "--init-timeout", "30"]
    with idle_stdin() as stdin:
        proc = subprocess.run(cmd, cwd=ROOT, stdin=stdin, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["size"] == 2
    return {c["name"]: c for c in results["cases"]}


GREEDY = [(m, s, k) for m in ("dense", "moe") for s in ("pipeline", "tensor") for k in (1, 3)] + [("untied", "tensor", 3)]


@pytest.mark.parametrize("model, strategy, depth", GREEDY)
def test_greedy_equals_mlx_lm_sharded(launched, model, strategy, depth):
    result = launched[f"{model}-{strategy}"]
    run = result["greedy"][str(depth)]
    assert len(result["plain"]) == TOKENS  # the reference runs the whole length (no EOS)
    assert run["tokens"] == result["plain"]
    # Each round keeps exactly the drafts greedy keeps; with a copy head, the draft for each
    # position is the token before it, so a round keeps the run of repeats that follows.
    plain, out = result["plain"], 1
    for drafted, accepted in run["rounds"]:
        assert drafted == depth
        if out >= TOKENS:
            break
        repeats = 0
        if model != "untied":
            while repeats < depth and out + repeats < TOKENS and plain[out + repeats] == plain[out - 1]:
                repeats += 1
            assert accepted == repeats or out + accepted >= TOKENS
        else:
            assert accepted == 0  # a random head: every draft rejected, rolled back on both ranks
        out += accepted + 1
    kept = {a for _, a in run["rounds"]}
    if model != "untied":
        assert kept >= ({0, 1} if depth == 1 else {0, 1, 2, 3})  # every acceptance count occurred


@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
def test_rank_0_stopping_early_stops_every_rank(launched, strategy):
    """A consumer on rank 0 that stops mid-generation (a stop string, a cancel) halts the followers
    at the next round's agreement; the jobs after it (every greedy test above) stay exact."""
    result = launched[f"dense-{strategy}"]
    assert result["stopped"] == result["plain"][:5]
    assert result["greedy"]["1"]["tokens"] == result["plain"]  # the next job ran in step on every rank


@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
def test_sampled_equals_one_process_with_the_same_seed(launched, models, strategy):
    """Rank 0 draws the seed and every rank derives the same keys, so the split run draws what one
    process draws. Pipeline logits are bit-identical to one process's (each layer runs whole on
    one rank); tensor ones differ in the last bits (the all-sums add partial products in another
    order, ~1e-5 here), so there equality also says no draw of this seed fell within that rounding
    of a boundary, which holds on this platform (MLX CPU) and is what a user sees."""
    result = launched[f"dense-{strategy}"]
    lm = load_checkpoint(models["dense"], mode="mtp")
    params = SamplingParams(max_tokens=TOKENS, **SAMPLED)
    one = [e.id for e in generate(lm, result["prompt"], params, SpecConfig("mtp", 3)) if isinstance(e, Token)]
    assert result["sampled"][0]["tokens"] == one
    assert one != result["plain"]  # it did sample
    assert any(a for _, a in result["sampled"][0]["rounds"])  # and drafts were accepted
    unseeded = result["sampled"][1]  # in step on both ranks (a draft that differed would be an error)
    assert unseeded["tokens"] and unseeded["rounds"]  # (its length is the draw's: EOS may come early)


def start_ranks(tmp_path: Path, plan: Path, n: int = 2, only=None, extra=()) -> list:
    """The ranks started directly, as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE): a rank that
    fails is then not ended by the launcher, so what ends the others is their own doing."""
    port = free_ports(n)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(n)]))
    procs = []
    for r in range(n) if only is None else only:
        env = dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hosts))
        procs.append(subprocess.Popen([sys.executable, str(RANK), "--plan", str(plan), *extra], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def ended(proc, timeout: float):
    """(exit status, seconds it took, stderr) of a process that must end within `timeout`."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, time.monotonic() - start, err


def one_error_line(err: str) -> str:
    """The single `dyno: error:` line of a rank's stderr (MLX's ring backend may add its own
    diagnostics before it); never a traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("dyno: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_rank_that_never_comes_up_ends_the_other(tmp_path, models):
    plan = plan_file(tmp_path, [case(models, "dense", "pipeline")])
    (rank0,) = start_ranks(tmp_path, plan, only=[0], extra=["--init-timeout", "2"])
    code, took, err = ended(rank0, 60)
    assert code != 0 and took < 30
    assert "rank 0: could not reach every rank within 2 s" in one_error_line(err)


@pytest.mark.parametrize("kind, strategy", [("die", "tensor"), ("stall", "pipeline")])
def test_rank_that_dies_or_stops_answering_ends_the_other(tmp_path, models, kind, strategy):
    # A dead peer's closed socket makes MLX raise within seconds; a silent one is the watchdog's (3 s).
    step_timeout = 30 if kind == "die" else 3
    plan = plan_file(tmp_path, [case(models, "dense", strategy, depths=[3], reference=False, step_timeout=step_timeout)],
                     fault={"rank": 1, "after_rounds": 4, "kind": kind, "stall_s": 60})
    rank0, rank1 = start_ranks(tmp_path, plan, extra=["--init-timeout", "30"])
    try:
        code, took, err = ended(rank0, 90)
    finally:
        rank1.kill()
        rank1.communicate()
    assert code != 0 and took < 45, (code, took, err)  # the stalled rank stays silent for 60 s
    line = one_error_line(err)
    if kind == "die":  # MLX notices the closed socket; on a loaded machine the watchdog may be first
        assert line.startswith("dyno: error: rank 0: ") and (
            "[ring] connection to a peer was lost" in line or "no answer from the other ranks" in line), line
    else:
        assert "rank 0: no answer from the other ranks for 3 s (after round 4)" in line


def test_split_checks_name_what_does_not_divide():
    """The bundled dyno-tiny (3 attention and GDN heads) splits by layers, not by heads; mlx-lm
    would shard its heads unevenly without a word, so loading refuses with one line."""
    from speculative.distributed import check_split

    config = json.loads((ROOT / "assets" / "dyno-tiny" / "config.json").read_text())
    check_split(config, "pipeline", 2)
    with pytest.raises(DynoError, match=r"over 2 ranks .* num_attention_heads 3, linear_num_key_heads 3, "
                                        r"linear_num_value_heads 3$"):
        check_split(config, "tensor", 2)
    with pytest.raises(DynoError, match="num_key_value_heads 3"):  # 3 KV heads cannot repeat over 4 ranks
        check_split({"num_attention_heads": 8, "num_key_value_heads": 3}, "tensor", 4)
    with pytest.raises(DynoError, match="needs 16 layers"):
        check_split(config, "pipeline", 16)


def test_order_travels_whole():
    """What rank 0 sends is what every rank runs: prompt, every sampling field, drafting, chunking;
    rank 0 draws a random seed when the request has none, which travels beside the request's fields
    (a request's own seed asks for plain mlx-lm's text and its coupled acceptance; a drawn one must not)."""
    from speculative.distributed import Order, order_for
    from helpers.drafts import drafted
    from speculative.thinking_budget import ThinkingBudget

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, max_tokens=9, seed=2**63 + 5,
                            logit_bias={7: -1.5, 3: 2.0}, repetition_penalty=1.1, presence_penalty=0.5,
                            thinking_budget=ThinkingBudget(16, 8, 9, (4, 9, 5), open=True))
    order = Order((1, 2, 3), params, SpecConfig("mtp", 2, 160), 64)
    assert Order.decode(order.encode()) == order
    unseeded = order_for((1, 2), SamplingParams(temperature=1.0), SpecConfig("mtp", 2), 64)
    assert unseeded.params.seed is None and isinstance(unseeded.rng_seed, int)
    assert Order.decode(unseeded.encode()) == unseeded
    assert order_for((1, 2), params, SpecConfig("mtp", 2), 64).rng_seed is None
    lm = load_checkpoint(BUNDLED_MODEL, mode="mtp")
    runs = [drafted(lm, unseeded.params, 2, 64, rng_seed=unseeded.rng_seed) for _ in range(2)]
    for r in runs:
        next(r.run([1, 2]))  # joined: its row made
    assert all(r.row.keys is None for r in runs)  # the lossless min(1, p/q) rule
    assert mx.array_equal(mx.random.uniform(key=runs[0].row.key), mx.random.uniform(key=runs[1].row.key))  # every rank alike


def test_link_projection():
    """The projection adds the link's latency per hop to the measured step (T1) and round times:
    with none it is the measured speedup, and as the link dominates it tends to
    (tokens per round) x hops / (hops + the agreement's)."""
    bench = load_tool("distributed_bench")
    t1, round_s, e = 0.020, 0.040, 2.5
    assert bench.project(t1, round_s, e, 2, 1, 0.0)["speedup"] == pytest.approx(e * t1 / round_s)
    assert bench.project(t1, round_s, e, 2, 1, 100.0)["speedup"] == pytest.approx(e * 2 / 3, rel=1e-3)
    assert bench.hops("pipeline", 2, 8, False) == 2 and bench.hops("tensor", 2, 8, False) == 32
    assert bench.hops("tensor", 2, 8, True) == 33
