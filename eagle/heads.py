"""EAGLE draft heads: one decoder layer that drafts tokens from the frozen target's hidden states.

Two kinds share one API (see docs/ARCHITECTURE.md):

* ``eagle1`` (EAGLE-1/2): ``fc([embedding(x_{i+1}) ; last_hidden_i])`` feeds one decoder layer whose output is
  read by the *target's* ``lm_head``. ``last_hidden`` is taken after the target's final norm, so the head
  has no norm of its own.
* ``eagle3`` (EAGLE-3): ``fc`` fuses several target layers (``aux_hidden``) into one feature; the decoder layer
  attends over ``[input_layernorm(embedding) ; hidden_norm(hidden)]`` (2h inputs), keeps ``hidden`` as the
  residual, and has its own ``norm`` + ``lm_head`` over a reduced draft vocabulary (``d2t`` / ``t2d``).

Parameter names follow the EAGLE-3 export layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``) so exporting is a near-identity mapping. The target's embedding (and, for eagle1, its lm_head) are
borrowed with :meth:`attach_target`, never registered: they are not in ``state_dict()`` and optimizers never
see them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from eagle.errors import EagleError
from eagle.features import default_aux_layers
from eagle.lazy_logits import TargetLogits

KINDS = ("eagle1", "eagle3")
INIT_STD = 0.02  # HF's default initializer_range


def _rope_from_hf(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from an HF config; rope params live in ``rope_parameters`` (transformers 5)
    or in ``rope_theta`` / ``rope_scaling`` attributes (older configs)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type rope (e.g. sliding/full attention): the draft layer is a full-attention layer
        params = params.get("full_attention") or next(iter(params.values()))
    if not isinstance(params, dict) or not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        if "rope_theta" not in params:
            params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default" and not params:
        return theta, None
    return theta, {"rope_type": rope_type, **params}


@dataclasses.dataclass
class HeadConfig:
    """A draft head: what to train, and once resolved against a target, its exact shape.

    The ``head:`` section of a run config sets the choices (``kind``, ``draft_vocab_size``, ``aux_layers``,
    ``fc_bias``) and leaves the shape unset; :meth:`for_target` fills the shape in from the target (one decoder
    layer of the target's width, heads, rope and norm eps). Checkpoints and exports store resolved configs, so
    they rebuild the head exactly (:meth:`to_dict` / :meth:`from_dict`).
    """

    kind: str = "eagle3"  # eagle3 (EAGLE-3: fused low/mid/high features, draft vocabulary) | eagle1 (EAGLE-1/2)
    draft_vocab_size: int | None = 8192  # eagle3: the most frequent loss-masked training tokens (null: all)
    aux_layers: list[int] | None = None  # eagle3: hidden-state ids fused (null: the features' or [2, L//2, L-3])
    fc_bias: bool = True  # eagle1: EAGLE-1/2 and SGLang give fc a bias; vLLM's EAGLE-1 drops it (train false)
    # the shape, from the target (null until resolved)
    hidden_size: int | None = None
    intermediate_size: int | None = None  # the decoder layer's MLP width (the target's)
    num_attention_heads: int | None = None  # attention heads (the target's)
    num_key_value_heads: int | None = None  # key/value heads (the target's)
    head_dim: int | None = None  # per-head width (the target's)
    vocab_size: int | None = None  # the target's vocabulary
    rms_norm_eps: float = 1e-6  # the target's RMSNorm epsilon
    rope_theta: float = 10000.0  # the target's rotary base
    rope_scaling: dict | None = None  # the target's rotary scaling (llama3, yarn, ...), exported with the head
    max_position_embeddings: int = 4096  # longest position the head's rotary tables cover
    target_hidden_size: int | None = None  # null: hidden_size
    hidden_act: str = "silu"  # the MLP activation (the target's)
    target_name: str = ""  # the target the head was trained against (filled in by training)
    target_fingerprint: str = ""  # a hash of that target's weights (filled in by training)

    def __post_init__(self) -> None:
        if self.vocab_size is not None and (self.draft_vocab_size is None or self.kind == "eagle1"):
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.aux_layers is not None:
            self.aux_layers = [int(i) for i in self.aux_layers]
        if self.kind == "eagle1" and self.hidden_size is not None:
            self.aux_layers = []

    @property
    def resolved(self) -> bool:
        """Whether the shape is known (a head can be built)."""
        return None not in (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                            self.num_key_value_heads, self.head_dim, self.vocab_size)

    @classmethod
    def from_target(
        cls,
        hf_config: Any,
        kind: str = "eagle3",
        draft_vocab_size: int | None = None,
        aux_layers: list[int] | None = None,
        target_name: str = "",
        target_fingerprint: str = "",
        fc_bias: bool = True,
    ) -> HeadConfig:
        """A head shaped like one decoder layer of the target (hidden, heads, rope, eps, MLP width)."""
        if kind not in KINDS:
            raise EagleError(f"unknown head kind {kind!r}: set head.kind to one of {', '.join(KINDS)}")
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        num_layers = int(text.num_hidden_layers)
        theta, scaling = _rope_from_hf(text)
        layers = (list(aux_layers) if aux_layers is not None else default_aux_layers(num_layers)) if kind == "eagle3" else []
        for layer in layers:
            if not 0 <= layer <= num_layers:
                raise EagleError(
                    f"aux layer {layer} is outside the target's hidden states 0..{num_layers}: "
                    f"set head.aux_layers to layer ids in that range"
                )
        return cls(
            kind=kind,
            hidden_size=hidden,
            intermediate_size=int(text.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            vocab_size=int(text.vocab_size),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            draft_vocab_size=draft_vocab_size if kind == "eagle3" else None,
            target_hidden_size=hidden,
            aux_layers=layers,
            hidden_act=str(getattr(text, "hidden_act", "silu")),
            target_name=target_name,
            target_fingerprint=target_fingerprint,
            fc_bias=fc_bias if kind == "eagle1" else True,
        ).validate()

    def for_target(self, hf_config: Any, aux_layers: list[int] | None = None, target_name: str = "",
                   target_fingerprint: str = "") -> HeadConfig:
        """This section's choices on the target's shape (``aux_layers``: when the section leaves them unset)."""
        return HeadConfig.from_target(
            hf_config, self.kind, self.draft_vocab_size,
            self.aux_layers if self.aux_layers is not None else aux_layers,
            target_name, target_fingerprint, self.fc_bias,
        )

    def validate(self) -> HeadConfig:
        """Raise EagleError on an inconsistent config (the shape only once resolved); returns self."""
        if self.kind not in KINDS:
            raise EagleError(f"unknown head kind {self.kind!r}: set head.kind to one of {', '.join(KINDS)}")
        if self.draft_vocab_size is not None and self.draft_vocab_size <= 0:
            raise EagleError(f"head.draft_vocab_size must be positive, got {self.draft_vocab_size}")
        if self.aux_layers is not None and len(set(self.aux_layers)) != len(self.aux_layers):
            raise EagleError(f"head.aux_layers must list distinct hidden-state ids, got {self.aux_layers}")
        if self.hidden_act not in ACT2FN:
            raise EagleError(f"unknown activation {self.hidden_act!r}: use one of transformers' ACT2FN names")
        if not self.resolved:
            return self
        if self.draft_vocab_size > self.vocab_size:
            raise EagleError(
                f"head.draft_vocab_size={self.draft_vocab_size} is larger than the target's vocabulary "
                f"({self.vocab_size}): lower head.draft_vocab_size"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise EagleError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}): fix the head config"
            )
        if self.kind == "eagle3" and not self.aux_layers:
            raise EagleError("an eagle3 head needs aux_layers: set head.aux_layers (e.g. [2, L//2, L-3])")
        return self

    def to_dict(self) -> dict:
        """A JSON-safe dict."""
        out = dataclasses.asdict(self)
        out["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> HeadConfig:
        """Inverse of :meth:`to_dict` for a resolved config; unknown or missing keys are refused by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise EagleError(f"unknown head config keys {unknown}: remove them (known: {sorted(names)})")
        cfg = cls(**data)
        if not cfg.resolved:
            missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "vocab_size") if data.get(k) is None]
            raise EagleError(
                f"head config lacks required keys {missing}: add them (or rebuild it with from_target)"
            )
        return cfg.validate()


class HeadCache:
    """Keys/values of the head's single attention layer, [B, n_kv, S, d], RoPE already applied."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        self.keys = keys
        self.values = values

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add T new entries; returns all keys/values (past + new)."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, n: int) -> None:
        """Keep the first n positions."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]

    def gather(self, indices: torch.Tensor) -> None:
        """Keep the positions in ``indices`` (LongTensor [n] for every row, or [B, n]), in that order."""
        if self.keys is None:
            return
        idx = indices.to(self.keys.device, torch.long)
        if idx.dim() == 1:
            self.keys, self.values = self.keys[:, :, idx], self.values[:, :, idx]
            return
        b, h, _, d = self.keys.shape
        idx = idx[:, None, :, None].expand(b, h, idx.shape[-1], d)
        self.keys, self.values = self.keys.gather(2, idx), self.values.gather(2, idx)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 like HF's Llama."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inv_freq(cfg: HeadConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and cos/sin scale; scaled variants go through HF's ROPE_INIT_FUNCTIONS."""
    scaling = dict(cfg.rope_scaling or {})
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default" and "partial_rotary_factor" not in scaling:
        dim = cfg.head_dim
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**scaling, "rope_type": rope_type, "rope_theta": cfg.rope_theta}
    hf = LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=params,
    )
    if rope_type == "default":  # partial rotary only
        dim = int(cfg.head_dim * scaling["partial_rotary_factor"])
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise EagleError(f"unsupported rope_type {rope_type!r}: use one of {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scale)


class Rotary(nn.Module):
    """cos/sin for position ids. The frequencies are a plain fp32 attribute, not a buffer, so ``.to(bf16)``
    cannot round them; a per-device copy is made on first use."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        inv_freq, self.scale = _inv_freq(cfg)
        self._inv_freq = {inv_freq.device: inv_freq}

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids.device
        if device not in self._inv_freq:
            self._inv_freq[device] = next(iter(self._inv_freq.values())).to(device)
        freqs = position_ids[..., None].float() * self._inv_freq[device]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` [B, Q] (long) of every sequence of ``x`` [B, T, ...]: [B, Q, ...]."""
    index = rows.to(x.device).view(*rows.shape, *([1] * (x.dim() - 2)))
    return x.gather(1, index.expand(*rows.shape, *x.shape[2:]))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, d] by cos/sin [B, T, r] (r <= d: partial rotary leaves the rest unchanged)."""
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, RoPE and an optional HeadCache."""

    def __init__(self, cfg: HeadConfig, in_features: int):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: HeadCache | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Keys/values from all T positions of ``x``; queries (and the output) only at ``rows`` [B, Q] when
        given, which needs an explicit ``attention_mask`` [B, 1, Q, S]."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        k = apply_rope(k, cos, sin)
        if rows is not None:
            if attention_mask is None:
                raise ValueError("attention over chosen query rows needs an explicit attention_mask")
            x, cos, sin = gather_rows(x, rows), gather_rows(cos, rows), gather_rows(sin, rows)
            t = rows.shape[1]
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        groups = self.n_heads // self.n_kv
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        causal = False
        if attention_mask is None:
            if past == 0:
                causal = True
            else:  # causal with an offset: query t sits at key position past + t
                keys = torch.arange(past + t, device=x.device)
                queries = past + torch.arange(t, device=x.device)
                attention_mask = (keys[None, :] <= queries[:, None])[None, None]
        elif attention_mask.shape[-1] != k.shape[2]:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} keys, expected {k.shape[2]}")
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """Gated MLP (SwiGLU for silu)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. eagle3: attention reads [input_layernorm(emb) ; hidden_norm(hidden)] and the
    residual is ``hidden``. eagle1: attention reads the fc output directly (EAGLE-1/2's first layer has no
    input_layernorm) and the residual is that fc output."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.kind = cfg.kind
        h = cfg.hidden_size
        if cfg.kind == "eagle3":
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h if cfg.kind == "eagle3" else h)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, emb, hidden, cos, sin, attention_mask, cache, rows=None) -> torch.Tensor:
        if self.kind == "eagle3":
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        else:
            x = hidden
        residual = hidden if rows is None else gather_rows(hidden, rows)
        h = residual + self.self_attn(x, cos, sin, attention_mask, cache, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Borrowed(tuple):
    """Borrowed target modules. A tuple is not registered by nn.Module, so neither state_dict() nor
    .to()/.parameters() see them; deepcopy (e.g. for an EMA copy of the head) shares them instead of
    copying the target."""

    def __deepcopy__(self, memo: dict) -> _Borrowed:
        return self


class _DraftHead(nn.Module):
    """Shared parts of both head kinds."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.rotary = Rotary(cfg)
        self.midlayer = DecoderLayer(cfg)
        self._target_modules = _Borrowed()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def attach_target(self, target_model: nn.Module) -> _DraftHead:
        """Borrow the target's (frozen) input embedding, and for eagle1 its logits (lm_head and post-processing,
        :class:`eagle.lazy_logits.TargetLogits`); returns self."""
        emb = target_model.get_input_embeddings()
        lm_head = target_model.get_output_embeddings() if self.config.kind == "eagle1" else None
        if emb.weight.shape[0] < self.config.vocab_size:
            raise EagleError(
                f"target embedding has {emb.weight.shape[0]} rows but the head expects vocab_size "
                f"{self.config.vocab_size}: build the head from this target's config"
            )
        if emb.weight.shape[1] != self.config.hidden_size:
            raise EagleError(
                f"target hidden size {emb.weight.shape[1]} != head hidden_size {self.config.hidden_size}: "
                f"build the head with HeadConfig.from_target(target.config)"
            )
        for m in (emb, lm_head):
            if m is not None:
                m.requires_grad_(False)
        # eagle1 drafts through the target's logits, its post-processing (scale, soft-cap) included
        self._target_modules = _Borrowed((emb,) if lm_head is None else (emb, TargetLogits(target_model)))
        return self

    @property
    def embed_tokens(self) -> nn.Module:
        if not self._target_modules:
            raise EagleError("the head has no target attached: call head.attach_target(target_model) first")
        return self._target_modules[0]

    def _param_dtype(self) -> torch.dtype:
        return self.midlayer.self_attn.q_proj.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target embeddings of input_ids, on the head's device and dtype (no gradient into the target)."""
        emb = self.embed_tokens
        with torch.no_grad():
            out = emb(input_ids.to(emb.weight.device))
        return out.to(device=input_ids.device, dtype=self._param_dtype())

    def project(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: HeadCache | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft step over T positions. ``hidden`` is the projected feature [B, T, h] (see :meth:`project`);
        ``attention_mask`` is bool [B|1, 1, T, S] (True = may attend) over the S = cache.length + T keys, or
        None for plain causal attention. Appends T entries to ``cache`` when given. Returns [B, T, h].

        ``rows`` [B, Q] (long): every position still gives its key and value, but only these positions are
        queried and returned ([B, Q, h]; the mask is then [B, 1, Q, S]). Training uses it to skip the
        attention output and MLP of positions whose result no loss reads."""
        emb = self.embed(input_ids)
        hidden = hidden.to(self._param_dtype())
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(input_ids.shape[0], -1)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        hidden = self._layer_input(emb, hidden)
        return self.midlayer(emb, hidden, cos, sin, attention_mask, cache, rows)

    def _layer_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class Eagle3Head(_DraftHead):
    """EAGLE-3 head: fc over the concatenated aux layers, one decoder layer, own norm + draft-vocab lm_head."""

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # identity vocabulary until set_draft_vocab: draft id i is target id i
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self._init_weights()

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary (see ``train.vocab.build_draft_vocab``)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise EagleError(
                f"draft vocabulary shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match the "
                f"head ({tuple(self.d2t.shape)} / {tuple(self.t2d.shape)}): rebuild it with "
                f"head.draft_vocab_size={self.config.draft_vocab_size}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the captured target layers [B, T, k*h_target] into the head's hidden [B, T, h]."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [B, T, draft_vocab]."""
        return self.lm_head(self.norm(out_hidden))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids."""
        return ids + self.d2t[ids]


class Eagle1Head(_DraftHead):
    """EAGLE-1/2 head: fc([emb ; hidden]) then one decoder layer; the target's lm_head reads its output."""

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self._init_weights()

    def project(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Identity: eagle1's fc acts on [emb ; hidden] inside forward."""
        return last_hidden

    def _layer_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([emb, hidden], dim=-1))

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the full target vocabulary, through the target's own lm_head."""
        if len(self._target_modules) < 2:
            raise EagleError("the head has no target attached: call head.attach_target(target_model) first")
        lm_head = self._target_modules[1]
        return lm_head(out_hidden.to(lm_head.weight.dtype))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Identity: eagle1 drafts over the target vocabulary."""
        return ids


def build_head(cfg: HeadConfig) -> Eagle1Head | Eagle3Head:
    """A freshly initialised head of ``cfg.kind`` (a resolved config: see :meth:`HeadConfig.for_target`)."""
    if not cfg.resolved:
        raise EagleError("the head config has no shape yet: resolve it against the target (HeadConfig.for_target)")
    cfg.validate()
    return Eagle3Head(cfg) if cfg.kind == "eagle3" else Eagle1Head(cfg)


__all__ = [
    "HeadConfig",
    "HeadCache",
    "Eagle1Head",
    "Eagle3Head",
    "build_head",
    "apply_rope",
    "KINDS",
]
