"""One rank of a distributed Dyno run (started by mlx.launch, or directly with MLX_RANK and MLX_HOSTFILE).

For each case of the plan (a JSON file): mlx-lm's own plain greedy decoding of the model split
the same way (its sharded_load + generate_step, every rank), then Dyno on the model split by
speculative.distributed (rank 0 leads, the others follow): greedy at each depth and sampled with
the given settings. Rank 0 writes the results as JSON.

A fault can be planted: {"rank": 1, "after_rounds": 3, "kind": "die" | "stall"} makes that rank
exit, or stop answering while keeping its connections open, as it reaches that agreement.
Any DynoError ends the rank with its one line on stderr (the watchdog writes its own line).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `speculative`

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import sharded_load  # noqa: E402

from speculative import distributed  # noqa: E402
from dyno_ui.device import device_from_env  # noqa: E402
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.errors import DynoError  # noqa: E402
from speculative.events import Round, Token  # noqa: E402


class FaultyRanks(distributed.Ranks):
    """Ranks whose `fault["rank"]` fails as it reaches agreement number `fault["after_rounds"]`."""

    fault: dict = {}

    def outcome(self, *args, **kw):
        f = self.fault
        if f and self.rank == f["rank"] and self.rounds == f["after_rounds"]:
            if f["kind"] == "die":
                os._exit(17)
            time.sleep(f.get("stall_s", 60))  # alive, connections open, silent
        return super().outcome(*args, **kw)


def plain_reference(case: dict, group, prompt, eos: set) -> list:
    """mlx-lm's greedy tokens on the model as its sharded_load splits it, cut after EOS."""
    split = {"pipeline_group" if case["strategy"] == "pipeline" else "tensor_group": group}
    model, _ = sharded_load(case["model"], **split)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=case["max_tokens"]):
        out.append(int(token))
        if out[-1] in eos:
            break
    return out


def dyno_run(lm, prompt, params: SamplingParams, spec: SpecConfig) -> dict:
    """Rank 0: one distributed generation, its tokens and (drafted, accepted) per round."""
    tokens, rounds = [], []
    start = time.perf_counter()
    for e in distributed.generate(lm, prompt, params, spec):
        if isinstance(e, Token):
            tokens.append(e.id)
        elif isinstance(e, Round):
            rounds.append([e.drafted, e.accepted])
    return {"tokens": tokens, "rounds": rounds, "seconds": time.perf_counter() - start}


def run_case(case: dict, group, dog, fault: dict) -> dict:
    lm = distributed.load_sharded(case["model"], case["strategy"], group, watchdog=dog,
                                  step_timeout=case.get("step_timeout", distributed.STEP_TIMEOUT), mode="mtp")
    if fault:
        lm.ranks = FaultyRanks(group, case["strategy"], dog, lm.ranks.step_timeout)
        lm.ranks.fault = fault
    prompt = lm.tokenizer.encode(case["prompt"])
    result = {"name": case["name"], "prompt": prompt}
    if case.get("reference", True):
        result["plain"] = plain_reference(case, group, prompt, lm.eos_token_ids)
    if group.rank() != 0:
        result["generations"] = distributed.follow(lm)
        return result
    greedy = SamplingParams(max_tokens=case["max_tokens"])
    if case.get("stop_after"):  # the consumer stops early (a stop string, a cancel): the followers must too
        events, tokens = distributed.generate(lm, prompt, greedy, SpecConfig("mtp", 3)), []
        for e in events:
            if isinstance(e, Token):
                tokens.append(e.id)
                if len(tokens) == case["stop_after"]:
                    break
        events.close()
        result["stopped"] = tokens
        distributed.keepalive(lm)  # and an idle "ping" between jobs
    result["greedy"] = {str(k): dyno_run(lm, prompt, greedy, SpecConfig("mtp", k)) for k in case.get("depths", [])}
    result["sampled"] = [dyno_run(lm, prompt, SamplingParams(max_tokens=case["max_tokens"], **s["params"]),
                                  SpecConfig("mtp", s["depth"])) for s in case.get("sampled", [])]
    distributed.release(lm)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True, help="JSON: {cases: [...], fault: {...} or null}")
    parser.add_argument("--out", help="where rank 0 writes the results")
    parser.add_argument("--init-timeout", type=float, default=distributed.INIT_TIMEOUT)
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    dog = distributed.Watchdog(grace=2.0)
    try:
        device_from_env()  # as the dyno command: the suite pins its subprocesses to the CPU
        group = distributed.init_group("ring", args.init_timeout, watchdog=dog)
        results = [run_case(case, group, dog, plan.get("fault")) for case in plan["cases"]]
    except DynoError as e:
        sys.stderr.write(f"dyno: error: {e.message}\n")
        return e.exit_code
    finally:
        dog.close()
    if group.rank() == 0 and args.out:
        Path(args.out).write_text(json.dumps({"size": group.size(), "cases": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
