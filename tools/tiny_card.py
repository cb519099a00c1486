"""Model cards and the short training summary for dyno-tiny (rendered from training_log.json)."""

from __future__ import annotations

from tiny_export import repo_ids

LICENSE_FRONT = """license: other
license_name: psf-2.0
license_link: https://docs.python.org/3/license.html"""


def _fmt_acc(xs: list[float]) -> str:
    return ", ".join(f"{x:.1%}" for x in xs)


def summary(r: dict) -> str:
    f, spec = r["final_heldout"], r["speculative_greedy_heldout"]
    first, last = r["train"][0], r["train"][-1]
    heads = [k for k in f if k.startswith("head")]
    lines = [
        f"{repo_ids(bool(r['args'].get('moe')))[0].split('/')[1]} training summary ({r['recipe']}, seed {r['args']['seed']}, Python {r['python']}, torch {r['torch']})",
        f"parameters: {r['parameters'] / 1e6:.2f}M ({r['head_parameters'] / 1e6:.2f}M MTP head)",
        f"steps: {r['steps']} x {r['args']['batch']} x {r['args']['seq_len']} tokens"
        f"{' (STOPPED EARLY by --minutes)' if r['stopped_early'] else ''}; "
        f"training {r['train_seconds'] / 60:.1f} min, total {r['total_seconds'] / 60:.1f} min",
        f"train loss trunk {first['trunk']:.3f} -> {last['trunk']:.3f}; "
        + "; ".join(f"{h} {first[h]:.3f} -> {last[h]:.3f}" for h in heads),
        f"held-out (bf16 weights, fp32 reference): trunk CE {f['trunk']:.3f}, "
        + ", ".join(f"{h} CE {f[h]:.3f}" for h in heads)
        + f"; acceptance proxy {f['accept_proxy']:.1%}",
        f"held-out, bf16 compute: trunk CE {r['final_heldout_bf16_compute']['trunk']:.3f}, "
        f"acceptance proxy {r['final_heldout_bf16_compute']['accept_proxy']:.1%}",
    ]
    for k in (1, 2, 3):
        d = spec[f"depth{k}"]
        lines.append(f"greedy speculative replay, depth {k}: {d['tokens_per_round']:.2f} tokens/round, "
                     f"acceptance by position {_fmt_acc(d['acceptance_by_position'])} "
                     f"(conditional {_fmt_acc(d['conditional_acceptance_by_position'])})")
    return "\n".join(lines) + "\n"


def original_card(r: dict, config: dict, verification: dict | None = None) -> str:
    t = config["text_config"]
    moe = bool(r["args"].get("moe"))
    REPO_ID, MLX_REPO_ID = repo_ids(moe)
    name, kind = REPO_ID.split("/")[1], "mixture-of-experts" if moe else "dense"
    arch, model_type = config["architectures"][0], config["model_type"]
    if moe:
        mlp = (f"{t['num_experts']} experts of {t['moe_intermediate_size']}, top-{t['num_experts_per_tok']}, plus a "
               f"sigmoid-gated shared expert of {t['shared_expert_intermediate_size']} (SiLU-gated; the head too)")
        head_tensors = "19 tensors under `mtp.*` (fused `experts.gate_up_proj` / `experts.down_proj`)"
    else:
        mlp, head_tensors = f"{t['intermediate_size']} (SiLU-gated)", "15 tensors under `mtp.*`"
    flag = " --moe" if moe else ""
    f, spec = r["final_heldout"], r["speculative_greedy_heldout"]
    held = ", ".join(f"`{m}`" for m in r["corpus"]["held_out_modules"])
    ver = ""
    if verification:
        ver = "\n## Verified with mlx-lm\n\n" + "\n".join(f"- {line}" for line in verification["lines"]) + "\n"
    return f"""---
{LICENSE_FRONT}
library_name: transformers
pipeline_tag: text-generation
tags:
- qwen3_5
- mtp
- speculative-decoding
- tiny
- code
---

# {name}

A tiny model with the **Qwen3.5 {kind} hybrid architecture and a trained multi-token-prediction (MTP)
head**, trained from scratch on the Python standard library's own source. It ships with
Dyno (MTP speculative decoding on MLX) so that every code path a real Qwen3.5 / 3.6 / 3.8
checkpoint takes (sharded original layout, `mtp.*` head tensors, zero-centred norms, HF conv1d layout,
tied embeddings, hybrid Gated DeltaNet cache) runs offline in tests and demos. It writes plausible
stdlib-flavoured Python; it is not a useful assistant.

Repo id: `{REPO_ID}` (this original, with the head). MLX conversion without the head: `{MLX_REPO_ID}`.

## Architecture (`{arch}`, `model_type: {model_type}`)

| | |
|---|---|
| parameters | {r['parameters'] / 1e6:.2f}M (MTP head {r['head_parameters'] / 1e6:.2f}M), bf16 |
| hidden / MLP | {t['hidden_size']} / {mlp} |
| layers | {t['num_hidden_layers']}: Gated DeltaNet, full attention every 4th (layers {', '.join(str(i) for i, x in enumerate(t['layer_types']) if x == 'full_attention')}) |
| full attention | gated (q_proj = query + output gate), {t['num_attention_heads']} heads / {t['num_key_value_heads']} KV head, head_dim {t['head_dim']}, q/k RMSNorm, partial RoPE {t['rope_parameters']['partial_rotary_factor']} (theta {t['rope_parameters']['rope_theta']:g}) |
| Gated DeltaNet | {t['linear_num_key_heads']} key / {t['linear_num_value_heads']} value heads of {t['linear_key_head_dim']}, conv kernel {t['linear_conv_kernel_dim']} |
| vocabulary | {t['vocab_size']} (byte-level BPE with Qwen's pre-tokenizer, Qwen special tokens), tied embeddings |
| MTP | `mtp_num_hidden_layers: 1`, `mtp_use_dedicated_embeddings: false`; {head_tensors} |
| context | trained on {r['args']['seq_len']}-token windows (`max_position_embeddings` {t['max_position_embeddings']}) |

The head is exactly the released Qwen3.5 MTP module: `e = embed_tokens(t_{{p+1}})` (shared),
`h = ` trunk hidden after the final norm, `x = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])`,
one full-attention decoder layer (same class as the trunk's) at RoPE position p, `mtp.norm`, then the
tied lm_head; row p predicts t_{{p+2}}. All RMSNorm weights are stored zero-centred (applied as `1 + w`),
except the DeltaNet output norm. `model.visual.*` is a **random, untrained placeholder** vision tower
(depth 1) present only for layout fidelity: images are not supported.

## Training

- Data: the CPython {r['python']} standard library `*.py` sources ({r['corpus']['train_files']} files;
  test suites, `encodings/`, `pydoc_data/`, `site-packages/` and a few data-like files skipped), plus
  {r['corpus']['chat_examples']} chat-formatted examples (a user asks for a top-level function or class of
  the training files, the assistant answers with its source in a fenced block): a packed stream of
  {r['corpus']['train_tokens']:,} tokens, of which the run saw {r['steps'] * r['args']['batch'] * r['args']['seq_len']:,}
  (random 512-token windows, about {r['steps'] * r['args']['batch'] * r['args']['seq_len'] / r['corpus']['train_tokens']:.1f} epochs).
- Held out (never trained on, used for every figure below): {held}
  ({r['corpus']['held_out_files']} files, {r['corpus']['held_out_tokens']:,} tokens).
- Tokenizer: `tokenizers` byte-level BPE trained on the training files, in the exact form transformers
  rebuilds for `qwen3_5` (NFC, Qwen split regex, ByteLevel); Python source round-trips exactly.
- Recipe: `python tools/train_tiny.py{flag} --out assets/{name} --threads {r['args']['threads']}` (torch {r['torch']}, transformers'
  `Qwen3_5ForCausalLM` and its layer classes; seed {r['args']['seed']}; {r['steps']} steps of
  {r['args']['batch']} x {r['args']['seq_len']} tokens; AdamW lr {r['args']['lr']} cosine; bf16 autocast;
  {r['train_seconds'] / 60:.0f} min on {r['machine']}). Loss = next-token CE + head CE with weights
  {r['args']['head_weights']} at depths 1..{len(r['args']['head_weights'])} (depth 2 trains the recursive use
  of the head: its own post-norm hidden and the next token at position + 1).
- Log: `training_log.json` (per-step losses for trunk and head), `training_summary.txt`.

## Measured on the held-out modules (exported bf16 weights)

- Trunk next-token CE {f['trunk']:.3f} nats; head CE {f['head1']:.3f} (depth 1).
- Acceptance proxy (teacher forced: head argmax on (t_{{p+1}}, h_p) == trunk argmax at p+1): {f['accept_proxy']:.1%}.
- Greedy speculative replay on the trunk's own greedy continuations (16 prompts x 128 tokens):
  depth 1: {spec['depth1']['tokens_per_round']:.2f} tokens/round; depth 2: {spec['depth2']['tokens_per_round']:.2f};
  depth 3: {spec['depth3']['tokens_per_round']:.2f} (acceptance by position {_fmt_acc(spec['depth3']['acceptance_by_position'])}).
{ver}
## Files

`config.json`, `generation_config.json`, `model.safetensors-0000{{1,2}}-of-00002.safetensors` +
`model.safetensors.index.json` (the `mtp.*` tensors in the last shard), `tokenizer.json`,
`tokenizer_config.json` (Qwen-style chat template; `enable_thinking` defaults to off), `vocab.json`,
`merges.txt`, `golden.safetensors` (fp32 reference trunk and head logits on a fixed input, see its
metadata), training log and summary.

## License

Trained on the Python standard library source, which is distributed under the PSF License Agreement
(https://docs.python.org/3/license.html); this card marks the model `psf-2.0` accordingly.
"""


def mlx_card(r: dict, verification: dict | None = None) -> str:
    REPO_ID, MLX_REPO_ID = repo_ids(bool(r["args"].get("moe")))
    name, mlx_name = REPO_ID.split("/")[1], MLX_REPO_ID.split("/")[1]
    ver = ""
    if verification:
        ver = "\n" + "\n".join(f"- {line}" for line in verification["lines"]) + "\n"
    return f"""---
base_model: {REPO_ID}
{LICENSE_FRONT}
library_name: mlx
pipeline_tag: text-generation
tags:
- mlx
- qwen3_5
- tiny
- code
---

# {mlx_name}

[`{REPO_ID}`](https://huggingface.co/{REPO_ID}) converted to MLX with
`python -m mlx_lm convert --hf-path assets/{name} --mlx-path assets/{mlx_name}` (bf16, not
quantized). Like community MLX conversions of Qwen3.5, it **drops the MTP head** (`mtp.*`) and the
vision tower while keeping `mtp_num_hidden_layers: 1` in the config; Dyno restores the head from the
original repo.

```python
from mlx_lm import load, generate
model, tokenizer = load("assets/{mlx_name}")
print(generate(model, tokenizer, prompt="def read_config(path):\\n", max_tokens=64))
```
{ver}"""
