"""A hybrid causal LM like Kimi Linear, in plain PyTorch: KDA layers with a full-attention
layer every ``full_attention_interval``-th layer, dense SwiGLU MLPs.

Every state is explicit: the cache is a tuple with one entry per layer, a
:class:`KDAState` (q/k/v conv states ``[B, D, W - 1]`` and the recurrent state
``[B, H, K, V]`` float32) or an :class:`AttentionState` (static KV cache
``[B, H, max_seq_len, head_dim]`` and the per-sequence length ``[B]`` int64). Three entry
points share the layers:

- :meth:`HybridLM.prefill` ``(input_ids, cache) -> (logits, new_cache)``: a prompt from an
  empty cache (``kda_ops.causal_conv1d`` and ``kda_ops.chunk_kda``), functional.
- :meth:`HybridLM.decode` ``(input_ids, cache) -> (logits, new_cache)``: one token,
  functional (what export needs).
- :meth:`HybridLM.decode_` ``(input_ids, cache) -> logits``: one token, writing every state
  back into ``cache`` in place (what serving with CUDA graphs needs).

The gated RMSNorm (:func:`gated_rms_norm_torch`) and the decode-time conv update
(:func:`conv_update_torch`) are written as plain torch ops on purpose: the Inductor passes
of ``lowering.inductor`` find them and substitute the fused ``kda`` ops.

``python examples/hybrid_model.py [--help]`` prefills random prompts into the tiny model
(random weights) and decodes greedily, eager and compiled with ``backend="kda"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kda_ops

GATE_ACTIVATIONS = ("sigmoid", "silu")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Model shape. Layer ``i`` is full attention when ``(i + 1) % full_attention_interval
    == 0``, else KDA. KDA heads and attention heads share ``num_heads`` × ``head_dim``."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    head_dim: int = 16
    conv_size: int = 4
    full_attention_interval: int = 4
    max_seq_len: int = 64
    norm_eps: float = 1e-6
    gate_activation: str = "sigmoid"
    lower_bound: Optional[float] = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "head_dim", "full_attention_interval", "max_seq_len")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"HybridConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.conv_size < 2:
            raise ValueError(f"HybridConfig.conv_size must be >= 2, got {self.conv_size}")
        if self.gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(
                f"HybridConfig.gate_activation must be one of {GATE_ACTIVATIONS}, "
                f"got {self.gate_activation!r}"
            )

    @classmethod
    def kimi_linear_48b(cls, **overrides: object) -> HybridConfig:
        """Kimi-Linear-48B attention dims (hidden 2304, 32 heads × 128, dense MLP 9216);
        pass ``num_layers``, ``vocab_size``, ``max_seq_len`` to size the rest."""
        dims = dict(hidden_size=2304, intermediate_size=9216, num_heads=32, head_dim=128,
                    vocab_size=163840, max_seq_len=8192)  # fmt: skip
        return cls(**{**dims, **overrides})

    def is_attention_layer(self, index: int) -> bool:
        return (index + 1) % self.full_attention_interval == 0

    @property
    def kda_layer_count(self) -> int:
        return sum(not self.is_attention_layer(i) for i in range(self.num_layers))


class KDAState(NamedTuple):
    """One KDA layer's decode state: conv states ``[B, H * head_dim, W - 1]`` (model dtype)
    and the recurrent state ``[B, H, head_dim, head_dim]`` float32."""

    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    recurrent: Tensor


class AttentionState(NamedTuple):
    """One attention layer's static KV cache ``[B, H, max_seq_len, head_dim]`` and the number
    of cached tokens per sequence ``[B]`` int64."""

    key: Tensor
    value: Tensor
    length: Tensor


LayerState = Union[KDAState, AttentionState]
Cache = tuple[LayerState, ...]


@dataclasses.dataclass(frozen=True)
class KDAKernels:
    """The KDA core: ``chunk`` (prefill) and ``recurrent`` (decode), both with FLA's keyword
    API and ``(o, final_state)`` results, and the prefill short conv ``conv`` with
    :func:`kda_ops.causal_conv1d`'s. The default is kda_ops; benchmarks swap in FLA's."""

    chunk: Callable[..., tuple[Tensor, Optional[Tensor]]] = kda_ops.chunk_kda
    recurrent: Callable[..., tuple[Tensor, Optional[Tensor]]] = kda_ops.fused_recurrent_kda
    conv: Callable[..., tuple[Tensor, Tensor]] = kda_ops.causal_conv1d


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain RMSNorm over the last dim in fp32, cast back to x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def gated_rms_norm_torch(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, activation: str = "sigmoid"
) -> Tensor:
    """``x * rsqrt(mean(x²) + eps) * weight * act(gate)`` over the last dim in fp32, cast
    back to x's dtype. x, gate ``[..., D]``; weight ``[D]``; act sigmoid or silu."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gate_f = gate.float()
    act = torch.sigmoid(gate_f) if activation == "sigmoid" else F.silu(gate_f)
    return (normed * weight.float() * act).to(x.dtype)


def conv_update_torch(x: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """One decode step of the depthwise causal conv + SiLU, as plain torch ops.

    x ``[B, D]``; conv_state ``[B, D, W - 1]`` (the last W - 1 inputs); weight ``[D, W]``.
    Returns y ``[B, D]`` (x's dtype, computed in fp32) and the new state ``[B, D, W - 1]``.
    """
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)  # shift in the new input
    y = F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)
    return y, window[..., 1:]


def _write_back(state: Tensor, new: Tensor, inplace: bool) -> Tensor:
    """In place: copy ``new`` into ``state`` and return ``state``; else return ``new``."""
    return state.copy_(new) if inplace else new


class ShortConv(nn.Module):
    """Depthwise causal conv (no bias) + SiLU over ``[B, T, D]``; weight ``[D, W]``."""

    def __init__(self, channels: int, width: int, kernels: KDAKernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, width) / width)
        self.kernels = kernels

    def prefill(self, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        return self.kernels.conv(x, self.weight, initial_state=state, activation="silu")

    def decode(self, x: Tensor, state: Tensor, inplace: bool) -> tuple[Tensor, Tensor]:
        """x ``[B, 1, D]`` -> (y ``[B, 1, D]``, state after the step)."""
        y, new_state = conv_update_torch(x.squeeze(1), state, self.weight)
        return y.unsqueeze(1), _write_back(state, new_state, inplace)


def inverse_softplus_of_log_uniform(size: int, low: float, high: float) -> Tensor:
    """Kimi Linear's dt_bias init (transformers' ``KimiLinearPreTrainedModel``): dt
    log-uniform in [low, high], stored as softplus⁻¹(dt), so that a gate input of 0
    decays by ``exp(A_log) * dt`` a token. ``dt_bias = 0`` would decay by
    ``exp(A_log) * ln 2``: e^-5.3 a token on average at A_log ~ log U(1, 16), which forgets
    a prompt within a few tokens and sends half the chunks' diagonal blocks past the
    dense path's e^80 (measured on this model's first KDA layer, T = 8192)."""
    dt = torch.empty(size).uniform_(math.log(low), math.log(high)).exp().clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class KDAAttention(nn.Module):
    """Kimi Delta Attention layer: projections, short convs, low-rank forget gate with
    A_log / dt_bias (gate in kernel), beta, output gate, gated RMSNorm, o_proj."""

    def __init__(self, config: HybridConfig, kernels: KDAKernels) -> None:
        super().__init__()
        heads, dim, hidden = config.num_heads, config.head_dim, config.hidden_size
        self.config, self.kernels = config, kernels
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(hidden, heads * dim, bias=False) for _ in range(3)
        )
        self.q_conv, self.k_conv, self.v_conv = (
            ShortConv(heads * dim, config.conv_size, kernels) for _ in range(3)
        )
        self.f_a_proj = nn.Linear(hidden, dim, bias=False)
        self.f_b_proj = nn.Linear(dim, heads * dim, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(inverse_softplus_of_log_uniform(heads * dim, 1e-3, 1e-1))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, dim, bias=False)
        self.g_b_proj = nn.Linear(dim, heads * dim, bias=True)
        self.o_norm_weight = nn.Parameter(torch.ones(dim))
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.config.num_heads, self.config.head_dim))

    def _core_kwargs(self, x: Tensor) -> dict[str, object]:
        """Everything but q, k, v: raw gate, beta logits and the in-kernel flags."""
        return dict(
            g=self._heads(self.f_b_proj(self.f_a_proj(x))),
            beta=self.b_proj(x),
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=self.config.lower_bound,
            output_final_state=True,
        )

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        gate = self._heads(self.g_b_proj(self.g_a_proj(x)))
        o = gated_rms_norm_torch(
            o, gate, self.o_norm_weight, self.config.norm_eps, self.config.gate_activation
        )
        return self.o_proj(o.flatten(-2))

    def prefill(self, x: Tensor, state: KDAState) -> tuple[Tensor, KDAState]:
        """x ``[B, T, hidden]`` from the state ``state`` (zeros for a fresh prompt)."""
        q, conv_q = self.q_conv.prefill(self.q_proj(x), state.conv_q)
        k, conv_k = self.k_conv.prefill(self.k_proj(x), state.conv_k)
        v, conv_v = self.v_conv.prefill(self.v_proj(x), state.conv_v)
        o, recurrent = self.kernels.chunk(
            self._heads(q), self._heads(k), self._heads(v),
            initial_state=state.recurrent, **self._core_kwargs(x),
        )  # fmt: skip
        return self._output(x, o), KDAState(conv_q, conv_k, conv_v, recurrent)

    def decode(self, x: Tensor, state: KDAState, inplace: bool) -> tuple[Tensor, KDAState]:
        """x ``[B, 1, hidden]``; with ``inplace`` the returned state is ``state``, updated."""
        q, conv_q = self.q_conv.decode(self.q_proj(x), state.conv_q, inplace)
        k, conv_k = self.k_conv.decode(self.k_proj(x), state.conv_k, inplace)
        v, conv_v = self.v_conv.decode(self.v_proj(x), state.conv_v, inplace)
        o, recurrent = self.kernels.recurrent(
            self._heads(q), self._heads(k), self._heads(v),
            initial_state=state.recurrent, **self._core_kwargs(x),
        )  # fmt: skip
        recurrent = _write_back(state.recurrent, recurrent, inplace)
        return self._output(x, o), KDAState(conv_q, conv_k, conv_v, recurrent)


def _write_slot(cache: Tensor, new: Tensor, slot: Tensor, inplace: bool) -> Tensor:
    """Write ``new`` ``[B, H, 1, D]`` at position ``slot[b]`` of ``cache`` ``[B, H, S, D]``
    (an ``index_put``: only B × H × D elements move, never the whole cache)."""
    indices = (torch.arange(cache.shape[0], device=cache.device), slot)
    by_position = cache.transpose(1, 2)  # [B, S, H, D]: (batch, slot) index the first dims
    if inplace:
        by_position.index_put_(indices, new.squeeze(2))
        return cache
    return by_position.index_put(indices, new.squeeze(2)).transpose(1, 2)


class FullAttention(nn.Module):
    """Causal multi-head attention (no positional encoding, like Kimi Linear's NoPE MLA
    layers) over a static KV cache, with SDPA."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        heads, dim, hidden = config.num_heads, config.head_dim, config.hidden_size
        self.config = config
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(hidden, heads * dim, bias=False) for _ in range(3)
        )
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[B, T, hidden]`` -> three ``[B, H, T, head_dim]``."""
        shape = (self.config.num_heads, self.config.head_dim)
        return tuple(p(x).unflatten(-1, shape).transpose(1, 2) for p in
                     (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip

    def _output(self, o: Tensor) -> Tensor:
        return self.o_proj(o.transpose(1, 2).flatten(-2))

    def prefill(self, x: Tensor, state: AttentionState) -> tuple[Tensor, AttentionState]:
        """x ``[B, T, hidden]``; the cache must be empty (lengths 0): writes slots ``[0, T)``."""
        q, k, v = self._qkv(x)
        length = x.shape[1]
        key = state.key.slice_scatter(k, dim=2, start=0, end=length)
        value = state.value.slice_scatter(v, dim=2, start=0, end=length)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self._output(o), AttentionState(key, value, state.length + length)

    def decode(
        self, x: Tensor, state: AttentionState, inplace: bool
    ) -> tuple[Tensor, AttentionState]:
        """x ``[B, 1, hidden]``: writes slot ``length`` of each sequence, attends to
        slots ``[0, length]``."""
        q, k, v = self._qkv(x)
        key = _write_slot(state.key, k, state.length, inplace)
        value = _write_slot(state.value, v, state.length, inplace)
        length = state.length.add_(1) if inplace else state.length + 1
        positions = torch.arange(key.shape[2], device=x.device)
        mask = (positions < length.view(-1, 1))[:, None, None, :]
        o = F.scaled_dot_product_attention(q, key, value, attn_mask=mask)
        return self._output(o), AttentionState(key, value, length)


class MLP(nn.Module):
    """Dense SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: token mixer (KDA or attention), then the MLP."""

    def __init__(self, config: HybridConfig, index: int, kernels: KDAKernels) -> None:
        super().__init__()
        self.eps = config.norm_eps
        self.is_attention = config.is_attention_layer(index)
        self.mixer = FullAttention(config) if self.is_attention else KDAAttention(config, kernels)
        self.mixer_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.mlp_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.mlp = MLP(config)

    def _mlp(self, x: Tensor) -> Tensor:
        return x + self.mlp(rms_norm_torch(x, self.mlp_norm, self.eps))

    def prefill(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        y, state = self.mixer.prefill(rms_norm_torch(x, self.mixer_norm, self.eps), state)
        return self._mlp(x + y), state

    def decode(self, x: Tensor, state: LayerState, inplace: bool) -> tuple[Tensor, LayerState]:
        y, state = self.mixer.decode(rms_norm_torch(x, self.mixer_norm, self.eps), state, inplace)
        return self._mlp(x + y), state


class HybridLM(nn.Module):
    """The hybrid causal LM. ``input_ids`` int64 ``[B, T]``; logits ``[B, T, vocab]``."""

    def __init__(self, config: HybridConfig, kernels: Optional[KDAKernels] = None) -> None:
        super().__init__()
        kernels = KDAKernels() if kernels is None else kernels
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, kernels) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def new_cache(self, batch_size: int, max_seq_len: Optional[int] = None) -> Cache:
        """An empty cache for ``batch_size`` sequences on the model's device and dtype; the
        KV caches hold ``max_seq_len`` tokens (default ``config.max_seq_len``)."""
        c = self.config
        max_seq_len = c.max_seq_len if max_seq_len is None else max_seq_len
        like = self.lm_head.weight
        channels, width = c.num_heads * c.head_dim, c.conv_size - 1

        def zeros(*shape: int, dtype: Optional[torch.dtype] = None) -> Tensor:
            return like.new_zeros(shape, dtype=dtype or like.dtype)

        def layer_state(index: int) -> LayerState:
            if c.is_attention_layer(index):
                kv = (batch_size, c.num_heads, max_seq_len, c.head_dim)
                return AttentionState(zeros(*kv), zeros(*kv), zeros(batch_size, dtype=torch.int64))
            convs = (zeros(batch_size, channels, width) for _ in range(3))
            recurrent = zeros(batch_size, c.num_heads, c.head_dim, c.head_dim, dtype=torch.float32)
            return KDAState(*convs, recurrent)

        return tuple(layer_state(i) for i in range(c.num_layers))

    def _check_ids(self, input_ids: Tensor, cache: Cache, decode: bool) -> None:
        if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("HybridLM: `input_ids` must be an int32/int64 tensor [B, T]")
        if input_ids.dim() != 2 or (decode and input_ids.shape[1] != 1):
            expected = "[B, 1]" if decode else "[B, T]"
            raise ValueError(
                f"HybridLM: `input_ids` must be {expected}, got {tuple(input_ids.shape)}"
            )
        if len(cache) != self.config.num_layers:
            raise ValueError(
                f"HybridLM: `cache` must hold {self.config.num_layers} layer states, "
                f"got {len(cache)}"
            )

    def _logits(self, x: Tensor) -> Tensor:
        return self.lm_head(rms_norm_torch(x, self.norm, self.config.norm_eps))

    def prefill(self, input_ids: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
        """A prompt ``[B, T]`` from an empty cache -> (logits ``[B, T, vocab]``, new cache)."""
        self._check_ids(input_ids, cache, decode=False)
        x, states = self.embed(input_ids), []
        for layer, state in zip(self.layers, cache):
            x, state = layer.prefill(x, state)
            states.append(state)
        return self._logits(x), tuple(states)

    def _decode(self, input_ids: Tensor, cache: Cache, inplace: bool) -> tuple[Tensor, Cache]:
        self._check_ids(input_ids, cache, decode=True)
        x, states = self.embed(input_ids), []
        for layer, state in zip(self.layers, cache):
            x, state = layer.decode(x, state, inplace)
            states.append(state)
        return self._logits(x), tuple(states)

    def decode(self, input_ids: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
        """One token per sequence ``[B, 1]`` -> (logits ``[B, 1, vocab]``, new cache);
        ``cache`` is left untouched."""
        return self._decode(input_ids, cache, inplace=False)

    def decode_(self, input_ids: Tensor, cache: Cache) -> Tensor:
        """:meth:`decode` that advances ``cache`` in place; returns the logits."""
        return self._decode(input_ids, cache, inplace=True)[0]

    forward = prefill


def mark_cache_static(cache: Cache) -> None:
    """Mark every cache tensor as a static address, so CUDA graphs (``mode="reduce-overhead"``)
    accept the in-place state updates of :meth:`HybridLM.decode_` and read the cache in place
    instead of copying it into the graph's inputs on every replay (a prefill from one empty
    cache, ``benchmarks/hybrid.py``)."""
    for state in cache:
        for tensor in state:
            torch._dynamo.mark_static_address(tensor)


def generate(model: HybridLM, prompt: Tensor, new_tokens: int, decode: Callable) -> Tensor:
    """Greedy continuation of ``prompt`` ``[B, T]``: the prefill, then ``new_tokens`` calls of
    ``decode`` (``model.decode_`` or a compiled one) advancing one cache in place."""
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + new_tokens)
    logits, cache = model.prefill(prompt, cache)
    tokens = [logits[:, -1:].argmax(-1)]
    for _ in range(new_tokens - 1):
        tokens.append(decode(tokens[-1], cache).argmax(-1))
    return torch.cat(tokens, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = HybridLM(HybridConfig(max_seq_len=args.prompt_length + args.new_tokens))
    model = model.to(args.device).eval().requires_grad_(False)
    prompt = torch.randint(model.config.vocab_size, (args.batch, args.prompt_length),
                           device=args.device)  # fmt: skip
    eager = generate(model, prompt, args.new_tokens, model.decode_)
    # backend="kda": the package's torch_dynamo_backends entry point (README's install).
    compiled = torch.compile(model.decode_, backend="kda", fullgraph=True)
    print(f"device={args.device} generated {tuple(eager.shape)}: {eager[0].tolist()}")
    same = torch.equal(generate(model, prompt, args.new_tokens, compiled), eager)
    print(f"compiled decode (backend='kda') gives the same tokens: {same}")


if __name__ == "__main__":
    main()
