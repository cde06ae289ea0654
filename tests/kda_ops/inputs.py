"""Random inputs for the KDA / GDN tests."""

from dataclasses import dataclass

import torch
from torch import Tensor

from kda_ops import signature


@dataclass
class RandomInputs:
    """Random delta-rule inputs with an initial state (``delta_rule_inputs``)."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    A_log: Tensor
    dt_bias: Tensor
    initial_state: Tensor

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.q, self.k, self.v, self.g, self.beta, self.A_log, self.dt_bias,
                self.initial_state)  # fmt: skip


def delta_rule_inputs(
    batch: int = 1,
    length: int = 16,
    heads: int = 2,
    value_heads: int | None = None,
    head_k: int = 8,
    head_v: int = 4,
    *,
    n_seqs: int | None = None,
    scalar_gate: bool = False,
    raw_gate: bool = False,
    unit_qk: bool = True,
    dtype: torch.dtype = torch.float64,
    requires_grad: bool = False,
) -> RandomInputs:
    """Inputs in FLA's layouts. Without ``raw_gate``, g is a log-decay in (-1, 0) and beta
    lies in (0, 1) (what callers pass with the in-kernel options off); with it, g and beta
    are raw pre-activations. ``unit_qk`` gives q and k unit rows (what keeps the recurrence
    stable without the in-kernel l2norm). Gate parameters and the state are float32
    (float64 with float64 inputs), as the ops require."""
    value_heads = value_heads or heads
    n_seqs = n_seqs or batch
    gate_shape = (batch, length, value_heads) + (() if scalar_gate else (head_k,))
    g = torch.randn(gate_shape) if raw_gate else -torch.rand(gate_shape)
    beta = torch.randn(batch, length, value_heads)
    q, k = torch.randn(2, batch, length, heads, head_k)
    if unit_qk:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    tensors = RandomInputs(
        q=q,
        k=k,
        v=torch.randn(batch, length, value_heads, head_v),
        g=g,
        beta=beta if raw_gate else torch.sigmoid(beta),
        A_log=torch.randn(value_heads) * 0.5,
        dt_bias=torch.randn(value_heads * (1 if scalar_gate else head_k)),
        initial_state=torch.randn(n_seqs, value_heads, head_k, head_v),
    )
    fp32_or_fp64 = torch.float64 if dtype == torch.float64 else torch.float32
    for name, t in vars(tensors).items():
        t = t.to(fp32_or_fp64 if name in ("A_log", "dt_bias", "initial_state") else dtype)
        setattr(tensors, name, t.requires_grad_(requires_grad))
    return tensors


def grouped(*args: object) -> tuple:
    """Arguments in an op's flat order (the seven input tensors, what lies between, the four
    options) grouped as the kernel launchers take them: ``(signature.DeltaRuleInputs, ...,
    signature.DeltaRuleOptions)``."""
    return (signature.DeltaRuleInputs(*args[:7]), *args[7:-4],
            signature.DeltaRuleOptions(*args[-4:]))  # fmt: skip
