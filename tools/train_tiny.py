"""Train dyno-tiny from scratch and write it in the original Hugging Face layout of a Qwen3.5 release.

    python tools/train_tiny.py --out assets/dyno-tiny --checkpoint /tmp/dyno-tiny-ckpt.pt   # ~45 min, 1 core
    python tools/train_tiny.py --out /tmp/tiny --steps 20                                  # smoke run
    python tools/convert_tiny_mlx.py        # then the MLX conversion (drops the head)
    python tools/check_tiny.py              # then the checks against mlx-lm; refreshes the model cards

Needs torch, transformers and tokenizers only (the `train` extra). The model is transformers' own
Qwen3_5ForCausalLM plus an MTP head built from its layer classes, trained with the reference torch kernels.
Deterministic for a given --seed, --steps, --threads and Python (the corpus is this interpreter's standard
library; its version goes in the card); a run killed midway resumes exactly from --checkpoint.
--minutes is a wall-clock safety cap: if it is hit, training stops early and the log says so.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import random
import shutil
import time

import torch

import tiny_card
from tiny_data import (
    HELD_OUT, TokenStream, chat_examples, corpus_fingerprint, list_sources, python_version, train_tokenizer,
    write_json,
)
from tiny_eval import greedy_continuations, heldout_losses, speculative_simulation
from tiny_export import (
    bf16_rounded, checkpoint_tensors, hf_config, token_ids, write_generation_config, write_golden, write_shards,
    write_tokenizer,
)
from tiny_model import MOE_SHAPE, TinyMTPModel, TinyShape, losses, text_config


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("assets/dyno-tiny"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe", action="store_true",
                   help="the mixture-of-experts variant (qwen3_5_moe: 4 experts, top-2, shared expert; MoE head)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=75.0, help="wall-clock cap for the training loop")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--head-weights", type=float, nargs="+", default=[0.5, 0.25],
                   help="loss weight of the head at depth 1, 2, ... (depth > 1 trains the recursion)")
    p.add_argument("--chat-share", type=float, default=1.0, help="fraction of chat examples kept")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; 1 is fastest on a shared 2-core machine (OpenMP barriers stall "
                        "when the other core is busy) and leaves a core free")
    p.add_argument("--checkpoint", type=pathlib.Path,
                   help="save training state here every --checkpoint-every steps and resume from it if it exists "
                        "(exactly: model, optimizer and data RNG); a finished one skips to evaluation + export")
    p.add_argument("--checkpoint-every", type=int, default=50)
    return p.parse_args()


def lr_at(step: int, args) -> float:
    """Linear warmup then cosine decay to 10%."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: TinyMTPModel, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def run_signature(args) -> dict:
    """The arguments a checkpoint must share with the run that resumes it."""
    keep = ("seed", "moe", "steps", "batch", "seq_len", "lr", "warmup", "head_weights", "chat_share", "threads")
    return {k: getattr(args, k) for k in keep}


def save_checkpoint(args, model, opt, gen, log, evals, done: bool, seconds: float, stopped_early=False) -> None:
    """Atomic write (tmp + rename) so a killed run never leaves a truncated checkpoint."""
    tmp = args.checkpoint.with_suffix(".tmp")
    torch.save({"args": run_signature(args), "model": model.state_dict(), "opt": opt.state_dict(),
                "gen": gen.get_state(), "log": log, "evals": evals, "done": done, "seconds": seconds,
                "stopped_early": stopped_early}, tmp)
    tmp.replace(args.checkpoint)


def main() -> None:
    args = parse_args()
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out: pathlib.Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    depth = len(args.head_weights)

    # Corpus and tokenizer.
    train_files, held_files = list_sources()
    shape = MOE_SHAPE if args.moe else TinyShape()
    tok = train_tokenizer([t for _, t in train_files], shape.vocab_size)
    ids = token_ids(tok)
    write_tokenizer(tok, out)
    write_generation_config(out, ids)
    from transformers import AutoTokenizer  # the chat template is applied through transformers itself

    tk = AutoTokenizer.from_pretrained(out)
    chats = chat_examples(train_files)
    chats = chats[: int(len(chats) * args.chat_share)]
    chat_docs = [tk.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                        tokenize=False) for q, a in chats]
    docs = [t for _, t in train_files] + chat_docs
    random.Random(args.seed).shuffle(docs)
    eot = ids["<|endoftext|>"]
    train_stream = TokenStream.build(docs, tok, eot)
    held_stream = TokenStream.build([t for _, t in held_files], tok, eot)
    window = args.seq_len + 1 + depth
    eval_windows = held_stream.tiled_windows(64, window)
    print(f"corpus: {len(train_files)} train files + {len(chats)} chat examples = {len(train_stream.ids)} tokens; "
          f"held out {len(held_files)} files = {len(held_stream.ids)} tokens", flush=True)

    # Model.
    cfg = text_config(shape, eos_token_id=eot, pad_token_id=eot)
    model = TinyMTPModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_head = sum(p.numel() for p in model.mtp.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters ({n_head / 1e6:.2f}M in the head)", flush=True)
    opt = make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)

    # Train: next-token CE + weighted head CE at depths 1..D, bf16 autocast with fp32 master weights.
    log, evals, done, seconds_before, stopped_early = [], [], False, 0.0, False
    if args.checkpoint and args.checkpoint.exists():
        ck = torch.load(args.checkpoint, weights_only=False)
        assert ck["args"] == run_signature(args), "checkpoint was made with other training arguments"
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        log, evals, done, seconds_before = ck["log"], ck["evals"], ck["done"], ck["seconds"]
        stopped_early = ck["stopped_early"]
        print(f"resumed from {args.checkpoint} at step {len(log)}", flush=True)
    t_train = time.time() - seconds_before
    for step in range(len(log), 0 if done else args.steps):
        if time.time() - t_train > args.minutes * 60:
            stopped_early = True
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        batch = train_stream.random_windows(gen, args.batch, window)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            parts = losses(model, batch, depth)
            loss = parts["trunk"] + sum(w * parts[f"head{j + 1}"] for j, w in enumerate(args.head_weights))
            if "router" in parts:
                loss = loss + shape.router_aux_loss_coef * parts["router"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        row = {"step": step + 1, "tokens": (step + 1) * args.batch * args.seq_len, "lr": lr_at(step, args),
               "seconds": round(time.time() - t_train, 1), "grad_norm": round(gnorm, 4)}
        row.update({k: round(v.item(), 4) for k, v in parts.items()})
        log.append(row)
        if step % 10 == 0:
            print(json.dumps(row), flush=True)
        if (step + 1) % args.eval_every == 0:
            ev = heldout_losses(model, eval_windows[:16], head_depth=depth)
            evals.append({"step": step + 1, **{k: round(v, 4) for k, v in ev.items()}})
            print("eval", json.dumps(evals[-1]), flush=True)
        if args.checkpoint and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            save_checkpoint(args, model, opt, gen, log, evals, False, time.time() - t_train)
    steps_done = len(log)
    train_seconds = seconds_before if done else time.time() - t_train
    if args.checkpoint and not done:
        save_checkpoint(args, model, opt, gen, log, evals, True, train_seconds, stopped_early)

    # Final evaluation on the exported (bf16) weights, fp32 compute.
    model.eval()
    ref = bf16_rounded(model)
    final = heldout_losses(ref, eval_windows, head_depth=depth)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        final_bf16 = heldout_losses(ref, eval_windows[:16], head_depth=depth)
    prompts = held_stream.tiled_windows(16, 64)
    seqs = greedy_continuations(ref, prompts, 128)
    spec = speculative_simulation(ref, seqs, prompt_len=64, depth=3)
    print("final", json.dumps(final), "\nbf16", json.dumps(final_bf16), "\nspec", json.dumps(spec), flush=True)

    # Export: config, sharded bf16 weights, golden file, log, card.
    tensors = checkpoint_tensors(model, args.seed)
    write_shards(tensors, out)
    config = hf_config(model, shape, ids)
    write_json(out / "config.json", config)
    golden_ids = held_stream.ids[1000:1024]
    golden = write_golden(model, golden_ids, out)
    record = {
        "recipe": "tools/train_tiny.py",
        "args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "python": python_version(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {args.threads} threads",
        "corpus": {
            "train_files": len(train_files), "held_out_files": len(held_files), "held_out_modules": list(HELD_OUT),
            "chat_examples": len(chats), "train_tokens": len(train_stream.ids),
            "held_out_tokens": len(held_stream.ids), "fingerprint": corpus_fingerprint(train_files + held_files),
        },
        "parameters": n_params, "head_parameters": n_head,
        "steps": steps_done, "stopped_early": stopped_early, "train_seconds": round(train_seconds, 1),
        # this process's wall time plus the training a resumed checkpoint had already done
        "total_seconds": round(time.time() - t_start + (train_seconds if done else seconds_before), 1),
        "final_heldout": final, "final_heldout_bf16_compute": final_bf16,
        "speculative_greedy_heldout": spec, "golden": golden,
        "evals": evals, "train": log,
    }
    write_json(out / "training_log.json", record)
    (out / "training_summary.txt").write_text(tiny_card.summary(record), encoding="utf-8")
    (out / "README.md").write_text(tiny_card.original_card(record, config), encoding="utf-8")
    print(tiny_card.summary(record), flush=True)


if __name__ == "__main__":
    main()
