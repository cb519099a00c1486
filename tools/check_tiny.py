"""Verify dyno-tiny against mlx-lm and transformers, and measure plain decoding speed.

    python tools/check_tiny.py [--hf-path assets/dyno-tiny] [--mlx-path assets/dyno-tiny-mlx]

Checks: tokenizer round trip (tokenizers, transformers AutoTokenizer and mlx_lm's wrapper agree and
reproduce every corpus file exactly); transformers loads the checkpoint as Qwen3_5ForConditionalGeneration;
mlx-lm trunk logits == torch logits (fp32); an independent MLX implementation of the MTP head (mlx-lm
layer classes, +1 on the 7 zero-centred head norms) reproduces the golden head and chain logits; greedy
acceptance proxy in MLX bf16; plain mlx-lm decoding tok/s. Writes verification.json and refreshes the cards.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import TextModelArgs
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP
from mlx_lm.sample_utils import make_sampler

import tiny_card
from tiny_data import TokenStream, list_sources

HEAD_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "input_layernorm",
              "post_attention_layernorm", "q_norm", "k_norm")


class MLXHead(nn.Module):
    """The MTP head in MLX from mlx-lm's own layer classes (for cross-checking the golden file)."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.self_attn = Qwen3NextAttention(args)
        self.mlp = Qwen3NextMLP(h, args.intermediate_size)
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def __call__(self, emb, hidden, cache, mask=None):
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], axis=-1))
        x = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x)


def load_head(path: pathlib.Path, args: TextModelArgs) -> MLXHead:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    weights = {}
    for shard in sorted({f for k, f in index.items() if k.startswith("mtp.")}):
        for k, v in mx.load(str(path / shard)).items():
            if not k.startswith("mtp."):
                continue
            k = k[len("mtp."):].replace("layers.0.", "")
            v = v.astype(mx.float32)
            if k.split(".")[-2] in HEAD_NORMS and v.ndim == 1:
                v = v + 1.0  # raw HF checkpoint: zero-centred norms
            weights[k] = v
    head = MLXHead(args)
    head.load_weights(list(weights.items()), strict=True)
    return head


def load_fp32(path: pathlib.Path):
    """mlx-lm's model with every weight read in fp32 and sanitized in fp32.

    mlx_lm.load adds the +1 of the zero-centred trunk norms in the checkpoint dtype (bf16), which rounds
    1 + w to 8 mantissa bits; for an exact fp32 comparison we run the same sanitize on fp32 tensors.
    """
    model, _ = load(str(path))
    weights = {}
    for shard in sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())):
        weights.update({k: v.astype(mx.float32) for k, v in mx.load(str(path / shard)).items()})
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    return model


def trunk_hidden(model, ids: mx.array, cache=None) -> tuple[mx.array, mx.array]:
    """(logits, post-norm hidden) from mlx-lm's trunk."""
    lm = model.language_model
    h = lm.model(ids, cache)
    return lm.model.embed_tokens.as_linear(h), h


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-path", type=pathlib.Path, default=pathlib.Path("assets/dyno-tiny"))
    p.add_argument("--mlx-path", type=pathlib.Path, default=pathlib.Path("assets/dyno-tiny-mlx"))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(2)
    report: dict = {}
    lines: list[str] = []

    # Tokenizers agree and round-trip every corpus file.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    model, wrapper = load(str(args.hf_path))
    raw = Tokenizer.from_file(str(args.hf_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(args.hf_path)
    train, held = list_sources()
    bad = []
    for rel, text in train + held:
        ids = raw.encode(text, add_special_tokens=False).ids
        if (auto.encode(text, add_special_tokens=False) != ids or wrapper.encode(text) != ids
                or wrapper.decode(ids) != text or auto.decode(ids) != text):
            bad.append(rel)
    report["tokenizer"] = {"files": len(train) + len(held), "mismatches": bad, "class": type(auto).__name__}
    lines.append(f"tokenizer ({type(auto).__name__} via transformers and mlx-lm): {len(train) + len(held)} "
                 f"stdlib files round-trip exactly, ids identical to tokenizer.json: {'yes' if not bad else bad}")

    # transformers loads the release layout; its logits equal mlx-lm's (fp32 compute on the bf16 weights).
    ref = Qwen3_5ForConditionalGeneration.from_pretrained(args.hf_path, dtype=torch.float32).eval()
    eot = raw.token_to_id("<|endoftext|>")
    stream = TokenStream.build([t for _, t in held], raw, eot)
    ids = stream.ids[5000:5256]
    with torch.no_grad():
        t_logits = ref(input_ids=ids[None]).logits[0].numpy()
    model.set_dtype(mx.float32)
    as_loaded = float(np.abs(np.array(trunk_hidden(model, mx.array(ids.numpy())[None])[0][0]) - t_logits).max())
    model = load_fp32(args.hf_path)
    m_logits, _ = trunk_hidden(model, mx.array(ids.numpy())[None])
    m_logits = np.array(m_logits[0])
    diff = float(np.abs(m_logits - t_logits).max())
    agree = float((m_logits.argmax(-1) == t_logits.argmax(-1)).mean())
    report["torch_vs_mlx_fp32"] = {"tokens": len(ids), "max_abs_diff": diff, "argmax_agreement": agree,
                                   "logit_scale": float(np.abs(t_logits).max()),
                                   "max_abs_diff_norms_shifted_in_bf16_by_mlx_lm_load": as_loaded}
    lines.append(f"mlx-lm vs transformers trunk logits, fp32 compute, {len(ids)} held-out tokens: max |diff| "
                 f"{diff:.1e} (logits up to {np.abs(t_logits).max():.1f}), argmax agreement {agree:.1%}; {as_loaded:.1e} "
                 "when mlx_lm.load's bf16 norm shift (1 + w rounded to bf16) is kept")

    # Golden file: trunk and an independent MLX head.
    gold = {k: np.array(v) for k, v in mx.load(str(args.hf_path / "golden.safetensors")).items()}
    targs = TextModelArgs.from_dict(json.loads((args.hf_path / "config.json").read_text())["text_config"])
    head = load_head(args.hf_path, targs)
    g_ids = mx.array(gold["input_ids"])[None]
    g_logits, g_hidden = trunk_hidden(model, g_ids)
    embed = model.language_model.model.embed_tokens
    cache = KVCache()
    L = g_ids.shape[1]
    hh = head(embed(mx.array(gold["head_tokens"])[None]), g_hidden, cache, mask="causal")
    h_logits = embed.as_linear(hh)
    chain = [h_logits[:, -1]]
    tok, hid = mx.argmax(h_logits[:, -1:], -1), hh[:, -1:]
    for _ in range(2):
        hid = head(embed(tok), hid, cache)
        lg = embed.as_linear(hid)
        chain.append(lg[:, -1])
        tok = mx.argmax(lg, -1)
    g = {
        "trunk_logits": float(np.abs(np.array(g_logits[0]) - gold["trunk_logits"]).max()),
        "head_logits": float(np.abs(np.array(h_logits[0]) - gold["head_logits"]).max()),
        "chain_logits": float(np.abs(np.array(mx.concatenate(chain, 0)) - gold["chain_logits"]).max()),
    }
    report["golden_vs_mlx_fp32"] = g
    lines.append(f"golden.safetensors ({L} tokens) reproduced in MLX fp32: trunk {g['trunk_logits']:.1e}, "
                 f"head {g['head_logits']:.1e}, depth-3 chain {g['chain_logits']:.1e} max |diff|")

    # Acceptance proxy with the bf16 weights in MLX (teacher forced on held-out text).
    model, _ = load(str(args.hf_path))
    head = load_head(args.hf_path, targs)
    head.set_dtype(mx.bfloat16)
    hits = total = 0
    for w in stream.tiled_windows(16, 513):
        x = mx.array(w.numpy())[None]
        lg, hd = trunk_hidden(model, x[:, :-1])
        hl = embed.as_linear(head(model.language_model.model.embed_tokens(x[:, 1:]), hd, KVCache(), mask="causal"))
        a = np.array(mx.argmax(hl[0, :-1], -1)) == np.array(mx.argmax(lg[0, 1:], -1))
        hits, total = hits + int(a.sum()), total + a.size
    report["accept_proxy_mlx_bf16"] = hits / total
    lines.append(f"acceptance proxy in MLX bf16 (held-out, teacher forced): {hits / total:.1%}")

    # The MLX conversion is the original minus the head: same tokenizer ids, same bf16 logits.
    if args.mlx_path.exists():
        conv, conv_tok = load(str(args.mlx_path))
        tok_same = all(conv_tok.encode(t) == wrapper.encode(t) for _, t in held)
        x = mx.array(ids.numpy())[None]
        orig_bf16, _ = load(str(args.hf_path))
        cdiff = float(mx.abs(conv(x).astype(mx.float32) - orig_bf16(x).astype(mx.float32)).max())
        report["mlx_conversion_vs_original"] = {"tokenizer_identical": tok_same, "bf16_logits_max_abs_diff": cdiff}
        lines.append(f"MLX conversion vs original under mlx_lm.load (bf16): logits max |diff| {cdiff:.1e}, "
                     f"tokenizer ids identical: {'yes' if tok_same else 'NO'}")

    # Plain decoding speed (mlx-lm stream_generate, greedy), original and MLX conversion.
    prompt = "import os\n\n\ndef read_config(path):\n"
    speeds = {}
    for name, path in (("original", args.hf_path), ("mlx", args.mlx_path)):
        if not path.exists():
            continue
        m, t = load(str(path))
        runs = []
        for i in range(args.runs + 1):
            last = None
            for last in stream_generate(m, t, prompt, max_tokens=args.tokens, sampler=make_sampler(0.0)):
                pass
            if i:
                runs.append(last.generation_tps)
        speeds[name] = {"median_tps": statistics.median(runs), "min": min(runs), "max": max(runs),
                        "tokens": last.generation_tokens}
    text = "".join(r.text for r in stream_generate(model, wrapper, prompt, max_tokens=96, sampler=make_sampler(0.0)))
    report["decode_tps"] = speeds
    report["sample"] = {"prompt": prompt, "greedy_continuation": text}
    for name, s in speeds.items():
        lines.append(f"plain mlx-lm decoding ({name}, bf16, {mx.default_device()}, mlx-lm stream_generate, greedy, "
                     f"{s['tokens']} tokens): median {s['median_tps']:.0f} tok/s (min {s['min']:.0f}, max {s['max']:.0f})")
    report["lines"] = lines
    report["mlx_lines"] = [ln for ln in lines if "decoding (mlx" in ln or "MLX conversion" in ln]
    (args.hf_path / "verification.json").write_text(json.dumps(report, indent=2) + "\n")
    record = json.loads((args.hf_path / "training_log.json").read_text())
    config = json.loads((args.hf_path / "config.json").read_text())
    (args.hf_path / "README.md").write_text(tiny_card.original_card(record, config, {"lines": lines}))
    if args.mlx_path.exists():
        (args.mlx_path / "README.md").write_text(tiny_card.mlx_card(record, {"lines": report["mlx_lines"]}))
    print("\n".join(lines))
    print("sample:", repr(prompt + text))


if __name__ == "__main__":
    main()
