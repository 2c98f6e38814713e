"""Typed configuration of the K3 model (the `model:` section of every job config) and its HF twin.

Field names and meanings are those of `KimiLinearConfig` in docs/model_spec.md §2 (the released
checkpoint format), plus what Part A adds: the router-balancing method (quantile balancing,
the DeepSeek sign update or none), RoPE on the MLA rope part (NoPE is the released default),
and the native image-patch path. The dataclass `ModelConfig` is the single source of truth:
OmegaConf checks YAML files and dotted CLI overrides against it, and the Hugging Face config
`K3Config` takes its fields, defaults and nested sections from it (nothing is typed twice).

Index conventions follow the spec: `linear_attn_config.kda_layers` is 1-based; every other
layer index (`first_k_dense_replace`, `moe_layer_freq`, AttnRes blocks) is 0-based.

`K3Config` is defined on first access (PEP 562 module `__getattr__`): building it imports
transformers (and torch, ~2 s), and this module must stay cheap because every job config
(`rl/config/`) imports `ModelConfig` before a CLI has parsed its arguments.
`validate_model_config` runs on plain dicts, so it can check an OmegaConf config without torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from transformers import PretrainedConfig as K3Config


@dataclass
class LinearAttnConfig:
    """The `linear_attn_config` dict of the spec (§2.2): the KDA layers and their shapes."""

    kda_layers: list[int] = field(default_factory=list)
    """1-based indices of KDA layers; every other layer is MLA."""
    full_attn_layers: list[int] = field(default_factory=list)
    """1-based indices of MLA layers; must be the complement of `kda_layers`. Either list may be
    left empty in a YAML file: it is then filled with the complement of the other."""
    num_heads: int = 4
    """KDA heads H."""
    head_dim: int = 32
    """KDA per-head dim K (= V); also the rank of the decay-gate projection `f_a`."""
    short_conv_kernel_size: int = 4
    """Width W of the depthwise causal conv on q/k/v."""
    gate_lower_bound: Optional[float] = -5.0
    """lb of the bounded decay `lb·σ(exp(A_log)·(f+dt_bias))`, in [-5, 0); null selects the
    unbounded `-exp(A_log)·softplus(f+dt_bias)` form."""
    use_full_rank_gate: bool = True
    """True (K3): full-rank output gate `g_proj`; False (Kimi-Linear): low-rank `g_a/g_b`."""


@dataclass
class RouterBalanceConfig:
    """Loss-free balancing of the routing bias `e_score_correction_bias` (docs/model_spec.md Part A)."""

    method: str = "quantile"
    """`quantile` (quantile balancing), `sign` (DeepSeek-V3 `b += γ·sign(T - load)`) or `none`."""
    step_size: float = 0.5
    """Damping of the quantile update (the fraction of the one-step correction applied)."""
    sign_gamma: float = 1e-3
    """γ of the sign update."""


@dataclass
class ModelConfig:
    """The K3 text model (spec §2.1) plus the native image-patch input (Part A)."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    """Width of the dense MLP (layers before `first_k_dense_replace`)."""
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    """MLA heads."""
    hidden_act: str = "situ"
    """`situ` (SiTU-GLU) or `silu` (SwiGLU), for dense, shared and routed experts."""
    activation_situ_beta: Optional[float] = 4.0
    activation_situ_linear_beta: Optional[float] = 25.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    max_position_embeddings: int = 8192
    """A length limit only (there is no position table); checked when a cache grows past it."""
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    tie_word_embeddings: bool = False
    """Kept for HF; must stay false (vLLM never ties `lm_head`, spec §2.1)."""
    logit_scale: float = 1.0
    """Multiplier of the logits (spec §1, step 4)."""
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    attn_res_block_size: Optional[int] = 2
    """S, layers per AttnRes block (spec §7); null disables AttnRes (plain pre-norm residual)."""
    q_lora_rank: Optional[int] = 64
    """MLA query low rank; null means a full-rank `q_proj`."""
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_use_nope: bool = True
    """True (released K3): no rotary anywhere. False: RoPE on the `qk_rope_head_dim` part."""
    mla_use_output_gate: bool = True
    rope_theta: float = 10000.0
    """RoPE base when `mla_use_nope` is false; the staged context recipe raises it per stage."""
    num_experts: Optional[int] = 8
    """Routed experts E; null means no MoE."""
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 128
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    """DeepSeek-style expert groups (spec §8.1); 1 with `topk_group=1` is a plain top-k."""
    topk_group: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    routed_expert_hidden_size: Optional[int] = None
    """Latent MoE width d_m; null means experts work in the hidden size."""
    latent_moe_use_norm: bool = False
    router_balance: RouterBalanceConfig = field(default_factory=RouterBalanceConfig)
    image_patch_size: int = 14
    """Side of the square image patches fused at the input."""
    image_num_channels: int = 3
    media_placeholder_token_id: Optional[int] = None
    """Token whose embedding rows are replaced by image patch embeddings; null: no images."""
    checkpoint_layout: Optional[str] = None
    """On-disk layout of saved models (model/formats/layouts.py): `kimi_linear` (text-only Kimi-Linear,
    `KimiLinearForCausalLM`), `kimi_k3` (`KimiK3ForConditionalGeneration`, text weights under
    `language_model.`), or null: `kimi_k3` when images are on (`media_placeholder_token_id` set), else
    `kimi_linear`."""


CHECKPOINT_LAYOUTS = (None, "kimi_linear", "kimi_k3")
"""Values of `ModelConfig.checkpoint_layout` (null: chosen by the image setting, model/formats/layouts.py `layout_for`)."""

_NESTED = {"linear_attn_config": LinearAttnConfig, "router_balance": RouterBalanceConfig}


def model_config_defaults() -> dict[str, Any]:
    """`ModelConfig()` as plain nested dicts (the form the HF config and config.json hold)."""
    return dataclasses.asdict(ModelConfig())


def _to_plain(value: Any) -> Any:
    """OmegaConf containers, dataclasses and tuples → plain dicts/lists (JSON-ready)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def resolve_model_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults ← `values` (nested sections merged key by key), with the layer lists completed.

    An empty `kda_layers` or `full_attn_layers` is filled with the complement of the other
    (both empty: every layer is MLA). Unknown keys of a nested section raise ValueError.
    """
    out = model_config_defaults()
    for key, value in _to_plain(dict(values)).items():
        if key in _NESTED and value is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"{key}: expected a mapping, got {value!r}")
            known = {f.name for f in dataclasses.fields(_NESTED[key])}
            for sub in value:
                if sub not in known:
                    raise ValueError(f"{key}.{sub}: unknown key; valid keys: {', '.join(sorted(known))}")
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    _check_types(out, ModelConfig)
    lac = out["linear_attn_config"]
    every = set(range(1, int(out["num_hidden_layers"]) + 1))
    kda, full = list(lac["kda_layers"] or []), list(lac["full_attn_layers"] or [])
    if not full:
        full = sorted(every - set(kda))
    if not kda:
        kda = sorted(every - set(full))
    lac["kda_layers"], lac["full_attn_layers"] = kda, full
    return out


_MAX_INT = 2**40
"""Larger than any real size, count or id: a bigger integer in a config.json is an error, not an allocation."""


def _check_types(values: Mapping[str, Any], schema: type, prefix: str = "") -> None:
    """ValueError naming the first field whose value does not have the dataclass field's type: integers (not
    bools) within ±2^40, finite numbers, strings, bools, lists of integers, nested sections. YAML and CLI
    values are already typed by OmegaConf; this is for config.json, which anyone can write."""
    import typing

    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        name, value = prefix + f.name, values.get(f.name)
        kind, optional = hints[f.name], False
        if typing.get_origin(kind) is typing.Union:
            kind, optional = next(a for a in typing.get_args(kind) if a is not type(None)), True
        if value is None and (optional or f.name not in values):
            continue
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, Mapping):
                raise ValueError(f"{name}: expected a mapping, got {value!r}")
            _check_types(value, kind, name + ".")
        elif kind is int:
            if not _is_int(value):
                raise ValueError(f"{name}: must be an integer within ±2^40, got {value!r}")
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
        elif kind is bool or kind is str:
            if not isinstance(value, kind):
                raise ValueError(f"{name}: must be a {kind.__name__}, got {value!r}")
        elif typing.get_origin(kind) is list:
            if not isinstance(value, list) or not all(_is_int(i) for i in value):
                raise ValueError(f"{name}: must be a list of integers, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= _MAX_INT


def _positive(v: dict, *names: str) -> None:
    for name in names:
        value = _get(v, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _get(v: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        v = v[part]
    return v


def validate_model_config(v: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first invalid field of a resolved config dict."""
    _positive(v, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "max_position_embeddings", "image_patch_size", "image_num_channels",
              "linear_attn_config.num_heads", "linear_attn_config.head_dim",
              "linear_attn_config.short_conv_kernel_size")
    L = v["num_hidden_layers"]
    lac = v["linear_attn_config"]
    for name in ("kda_layers", "full_attn_layers"):
        layers = lac[name]
        bad = [i for i in layers if not isinstance(i, int) or not 1 <= i <= L]
        if bad:
            raise ValueError(f"linear_attn_config.{name}: 1-based layer indices must lie in [1, {L}], got {bad}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"linear_attn_config.{name}: repeated layer indices {sorted(layers)}")
    if sorted(lac["full_attn_layers"]) != sorted(set(range(1, L + 1)) - set(lac["kda_layers"])):
        raise ValueError(
            f"linear_attn_config.full_attn_layers: must be the complement of kda_layers in 1..{L}; "
            f"got full_attn_layers={sorted(lac['full_attn_layers'])}, kda_layers={sorted(lac['kda_layers'])}")
    lb = lac["gate_lower_bound"]
    if lb is not None and not (isinstance(lb, (int, float)) and -5.0 <= lb < 0.0):
        raise ValueError(f"linear_attn_config.gate_lower_bound: must lie in [-5, 0) or be null, got {lb!r}")
    for name in ("rms_norm_eps", "initializer_range", "routed_scaling_factor"):
        if not v[name] > 0:
            raise ValueError(f"{name}: must be positive, got {v[name]!r}")
    if v["hidden_act"] not in ("situ", "silu"):
        raise ValueError(f"hidden_act: must be 'situ' or 'silu', got {v['hidden_act']!r}")
    for name in ("activation_situ_beta", "activation_situ_linear_beta"):
        if v[name] is not None and not v[name] > 0:
            raise ValueError(f"{name}: must be positive or null, got {v[name]!r}")
    if v["hidden_act"] == "situ" and v["activation_situ_beta"] is None:
        raise ValueError("activation_situ_beta: hidden_act='situ' needs a β (the spec's dense-MLP default is 1.0)")
    if v["tie_word_embeddings"]:
        raise ValueError("tie_word_embeddings: K3 keeps a separate lm_head (spec §2.1); must be false")
    if v["q_lora_rank"] is not None:
        _positive(v, "q_lora_rank")
    rope = v["qk_rope_head_dim"]
    if not isinstance(rope, int) or rope < 0 or (not v["mla_use_nope"] and (rope == 0 or rope % 2)):
        raise ValueError(f"qk_rope_head_dim: must be ≥ 0, and positive and even when RoPE is on "
                         f"(mla_use_nope=false), got {rope!r}")
    if not v["mla_use_nope"] and not v["rope_theta"] > 1.0:
        raise ValueError(f"rope_theta: must be > 1, got {v['rope_theta']!r}")
    if v["attn_res_block_size"] is not None:
        _positive(v, "attn_res_block_size")
    _validate_moe(v)
    token_ids = ("pad_token_id", "bos_token_id", "eos_token_id", "media_placeholder_token_id")
    for name in token_ids:
        if v[name] is not None and not 0 <= v[name] < v["vocab_size"]:
            raise ValueError(f"{name}: must lie in [0, vocab_size={v['vocab_size']}), got {v[name]!r}")
    if not (isinstance(v["logit_scale"], (int, float)) and math.isfinite(v["logit_scale"])):
        raise ValueError(f"logit_scale: must be a finite number, got {v['logit_scale']!r}")
    if v["checkpoint_layout"] not in CHECKPOINT_LAYOUTS:
        raise ValueError(f"checkpoint_layout: must be null, kimi_linear or kimi_k3, got {v['checkpoint_layout']!r}")


def _validate_moe(v: Mapping[str, Any]) -> None:
    _positive(v, "moe_layer_freq")
    if not 0 <= v["first_k_dense_replace"] <= v["num_hidden_layers"]:
        raise ValueError(f"first_k_dense_replace: must lie in [0, num_hidden_layers], got {v['first_k_dense_replace']}")
    if v["num_experts"] is None:
        return
    _positive(v, "num_experts", "num_experts_per_token", "moe_intermediate_size", "num_shared_experts",
              "num_expert_group", "topk_group")
    E, k = v["num_experts"], v["num_experts_per_token"]
    if k > E:
        raise ValueError(f"num_experts_per_token: top-k {k} exceeds num_experts {E}")
    if E % v["num_expert_group"]:
        raise ValueError(f"num_expert_group: {v['num_expert_group']} does not divide num_experts {E}")
    if v["topk_group"] > v["num_expert_group"]:
        raise ValueError(f"topk_group: {v['topk_group']} exceeds num_expert_group {v['num_expert_group']}")
    if v["moe_router_activation_func"] not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_router_activation_func: must be 'sigmoid' or 'softmax', got "
                         f"{v['moe_router_activation_func']!r}")
    if v["routed_expert_hidden_size"] is not None:
        _positive(v, "routed_expert_hidden_size")
    if v["router_balance"]["method"] not in ("quantile", "sign", "none"):
        raise ValueError(f"router_balance.method: must be quantile, sign or none, got {v['router_balance']['method']!r}")


@functools.cache
def _define_k3_config() -> type:
    from transformers import AutoConfig, PretrainedConfig

    class K3Config(PretrainedConfig):
        """HF config of the K3 text model: every `ModelConfig` field as a plain attribute.

        `linear_attn_config` and `router_balance` are plain dicts (as in the released
        config.json); missing keys take the dataclass defaults. Invalid values raise ValueError
        naming the field (`validate_model_config`). `model_type` is "k3rl_k3", in memory only:
        transformers already owns "kimi_linear" (a different module layout), so ours registers its
        own name; on disk a K3 directory is always one of the released layouts, written and read by
        model/formats/layouts.py (which reads the old "k3rl_k3" directories too).
        """

        model_type = "k3rl_k3"
        keys_to_ignore_at_inference = ["cache"]

        def __init__(self, **kwargs: Any) -> None:
            fields = set(model_config_defaults())
            values = resolve_model_values({k: kwargs.pop(k) for k in list(kwargs) if k in fields})
            validate_model_config(values)
            super().__init__(**values, **kwargs)

        @classmethod
        def from_model_config(cls, cfg: Any, **kwargs: Any) -> K3Config:
            """From a `ModelConfig`, an OmegaConf `model:` section or a dict."""
            return cls(**_to_plain(cfg), **kwargs)

        def model_config_dict(self) -> dict[str, Any]:
            """The `ModelConfig` fields only (e.g. to write a `model:` YAML section)."""
            return {k: _to_plain(getattr(self, k)) for k in model_config_defaults()}

        def is_kda_layer(self, layer_idx: int) -> bool:
            """Spec §3: KDA iff the 1-based index is listed in `kda_layers`."""
            return (layer_idx + 1) in self.linear_attn_config["kda_layers"]

        @property
        def is_moe(self) -> bool:
            return self.num_experts is not None

        @property
        def is_linear_attn(self) -> bool:
            return bool(self.linear_attn_config["kda_layers"])

        @property
        def is_mla(self) -> bool:
            return bool(self.linear_attn_config["full_attn_layers"])

    K3Config.__module__ = __name__
    K3Config.__qualname__ = "K3Config"
    AutoConfig.register(K3Config.model_type, K3Config, exist_ok=True)
    return K3Config


def __getattr__(name: str) -> Any:
    if name == "K3Config":
        # Cached in the module namespace, so later lookups do not come back here.
        globals()["K3Config"] = cls = _define_k3_config()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
