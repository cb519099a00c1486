"""dyno-tiny in PyTorch: the Qwen3.5 trunk from transformers plus an MTP head built from its layer classes.

The head follows /work/shared/docs/mtp-reference.md to the letter:
    e = embed_tokens(token)                       (shared with the trunk)
    h = trunk hidden AFTER the final norm
    x = fc(cat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)], -1))   (embedding first, no bias)
    x = full-attention Qwen3_5DecoderLayer(x)     (gated attention, q/k norm, partial RoPE, dense MLP)
    logits = lm_head(mtp.norm(x))                 (the trunk's lm_head; tied here)
Row alignment: head row p takes (t_{p+1}, h_p), uses RoPE position p and predicts t_{p+2}.
Depth j > 1 feeds the draft token from depth j-1 and the head's own post-norm output, position + 1.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
    Qwen3_5RMSNorm,
)
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeRMSNorm,
    load_balancing_loss_func,
)


@dataclass(frozen=True)
class TinyShape:
    """The architecture knobs of dyno-tiny (everything else is fixed Qwen3.5 convention)."""

    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 3
    num_key_value_heads: int = 1
    head_dim: int = 64
    linear_num_key_heads: int = 3
    linear_num_value_heads: int = 3
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    rope_theta: float = 100000.0
    max_position_embeddings: int = 4096
    # Mixture of experts (0 experts = the dense model): every MLP, the head's included, becomes a
    # routed top-k block plus a sigmoid-gated shared expert, as in Qwen3.5/3.6-35B-A3B.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 128
    router_aux_loss_coef: float = 0.001

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


MOE_SHAPE = TinyShape(num_experts=4)


def text_config(shape: TinyShape, eos_token_id: int, pad_token_id: int) -> Qwen3_5TextConfig:
    """The trunk's text config: full attention every 4th layer, partial RoPE 0.25, tied lm_head."""
    n = shape.num_hidden_layers
    rot_half = int(shape.head_dim * 0.25) // 2  # mrope sections split the rotary half-dim (text: all equal)
    sec = [rot_half - 2 * (rot_half // 3), rot_half // 3, rot_half // 3]
    if shape.moe:
        cls, mlp = Qwen3_5MoeTextConfig, dict(
            num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
            router_aux_loss_coef=shape.router_aux_loss_coef)
    else:
        cls, mlp = Qwen3_5TextConfig, dict(intermediate_size=shape.intermediate_size)
    cfg = cls(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        **mlp,
        num_hidden_layers=n,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": shape.rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": sec,
            "mrope_interleaved": True,
        },
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        initializer_range=0.02,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


class MTPHead(nn.Module):
    """One MTP layer; attribute names give the checkpoint keys `mtp.fc.weight`, `mtp.layers.0.*`, ..."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        h = cfg.hidden_size
        moe = isinstance(cfg, Qwen3_5MoeTextConfig)
        Layer, Norm = (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm) if moe else (Qwen3_5DecoderLayer, Qwen3_5RMSNorm)
        layer_cfg = copy.deepcopy(cfg)
        layer_cfg.num_hidden_layers = 1
        layer_cfg.layer_types = ["full_attention"]  # the trunk's full-attention decoder layer class
        layer_cfg._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Norm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Norm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(layer_cfg, 0)])
        self.norm = Norm(h, eps=cfg.rms_norm_eps)

    def project(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc(cat([norm_e(e), norm_h(h)])): the layer input for one block of rows."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, x: torch.Tensor, position_embeddings, mask: torch.Tensor) -> torch.Tensor:
        """Decoder layer then mtp.norm over rows x [B, R, H] with a bool mask [R, R] (True = attend)."""
        y = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask[None, None])
        return self.norm(y)


class TinyMTPModel(nn.Module):
    """Trunk (`Qwen3_5ForCausalLM`) + `mtp` head; `lm` and `mtp` map to checkpoint prefixes."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        self.moe = isinstance(cfg, Qwen3_5MoeTextConfig)
        self.lm = (Qwen3_5MoeForCausalLM if self.moe else Qwen3_5ForCausalLM)(cfg)
        self.mtp = MTPHead(cfg)
        init_head(self.mtp, cfg.initializer_range)

    @property
    def config(self) -> Qwen3_5TextConfig:
        return self.lm.config

    def trunk(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, L] -> (logits [B, L, V], post-norm hidden [B, L, H])."""
        logits, h, _ = self.trunk_with_router_loss(ids)
        return logits, h

    def trunk_with_router_loss(self, ids: torch.Tensor):
        """trunk() plus, for MoE, the load-balancing loss (Switch Transformer) as transformers computes it."""
        if not self.moe:
            h = self.lm.model(input_ids=ids).last_hidden_state
            return self.lm.lm_head(h), h, None
        out = self.lm.model(input_ids=ids, output_router_logits=True)
        c = self.config
        aux = load_balancing_loss_func(out.router_logits, c.num_experts, c.num_experts_per_tok)
        return self.lm.lm_head(out.last_hidden_state), out.last_hidden_state, aux

    def head_chain(self, hidden: torch.Tensor, tokens: list[torch.Tensor], greedy_tail: bool = False):
        """Run the head to depth D = len(tokens) (or more with greedy_tail) over all rows at once.

        hidden [B, L, H]: trunk post-norm hiddens h_0..h_{L-1}. tokens[0] [B, L] holds t_{p+1} for row p;
        tokens[j] the token fed at depth j+1 (teacher forced) — if greedy_tail, depth j+1 instead feeds
        the argmax of depth j (exactly what drafting does). Block j row p sits at position p + j and
        attends block-1 rows <= p (committed rows built from trunk hiddens) and rows p of blocks 2..j.
        Returns lists of logits [B, L, V] and post-norm hiddens, one per depth.
        """
        B, L, _ = hidden.shape
        depth = len(tokens)
        embed = self.lm.model.embed_tokens
        rotary = self.lm.model.rotary_emb
        xs, logits, hiddens = [], [], []
        h, tok = hidden, tokens[0]
        for j in range(depth):
            xs.append(self.mtp.project(embed(tok), h))
            x = torch.cat(xs, dim=1)  # [B, (j+1)L, H]
            pos = torch.cat([torch.arange(L) + i for i in range(j + 1)])[None]
            pe = rotary(x, pos)
            out = self.mtp(x, pe, chain_mask(L, j + 1))[:, j * L :]
            lg = self.lm.lm_head(out)
            logits.append(lg)
            hiddens.append(out)
            h = out
            if j + 1 < depth:
                tok = lg.argmax(-1) if greedy_tail else tokens[j + 1]
        return logits, hiddens


def chain_mask(L: int, blocks: int) -> torch.Tensor:
    """Bool [bL, bL]: block 1 causal; block j row p sees block-1 rows <= p and rows p of blocks 2..j."""
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    eye = torch.eye(L, dtype=torch.bool)
    zero = torch.zeros(L, L, dtype=torch.bool)
    rows = [[causal] + [eye if 0 < i <= j else zero for i in range(1, blocks)] for j in range(blocks)]
    return torch.cat([torch.cat(r, dim=1) for r in rows], dim=0)


def init_head(head: MTPHead, std: float) -> None:
    """Same init as the trunk: normal(0, std) linears and expert tensors, zero (i.e. identity, zero-centred)
    RMSNorm weights. (The expert tensors and router are bare Parameters, created uninitialised.)"""
    for m in head.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, (Qwen3_5RMSNorm, Qwen3_5MoeRMSNorm)):
            nn.init.zeros_(m.weight)
    for name, p in head.named_parameters():
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            nn.init.normal_(p, 0.0, std)


def losses(model: TinyMTPModel, window: torch.Tensor, head_depth: int) -> dict[str, torch.Tensor]:
    """Next-token CE for the trunk and depth-j CE for the head on a window [B, L + 1 + head_depth].

    Trunk row p reads t_0..t_p and predicts t_{p+1}; head depth j row p is fed t_{p+j} (teacher forced)
    and predicts t_{p+j+1}. Also returns the teacher-forced acceptance proxy: head depth-1 argmax at
    row p == trunk argmax at row p + 1.
    """
    L = window.shape[1] - 1 - head_depth
    ids = window[:, :L]
    logits, hidden, router = model.trunk_with_router_loss(ids)
    out = {"trunk": F.cross_entropy(logits.flatten(0, 1), window[:, 1 : L + 1].flatten())}
    if router is not None:
        out["router"] = router
    if head_depth:
        toks = [window[:, 1 + j : L + 1 + j] for j in range(head_depth)]
        head_logits, _ = model.head_chain(hidden, toks)
        for j, lg in enumerate(head_logits):
            out[f"head{j + 1}"] = F.cross_entropy(lg.flatten(0, 1), window[:, 2 + j : L + 2 + j].flatten())
        with torch.no_grad():
            hit = head_logits[0][:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)
            out["accept_proxy"] = hit.float().mean()
    return out
