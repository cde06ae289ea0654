"""kda-ops in one page: a Kimi-K3-style KDA layer core, prefilled, decoded, compiled, exported.

Runs on CPU (the reference kernels) or on a CUDA GPU. Usage: ``python examples/quickstart.py``.
"""

import argparse

import torch

import kda_ops

argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# Shapes in FLA's layout: q, k [B, T, H, K]; v [B, T, HV, V]; raw gate g [B, T, HV, K].
B, T, H, D = 2, 100, 4, 64
dtype = torch.bfloat16 if device == "cuda" else torch.float32
q, k, v, g = (torch.randn(B, T + 1, H, D, device=device, dtype=dtype) for _ in range(4))
beta_logits = torch.randn(B, T + 1, H, device=device, dtype=dtype)
A_log = torch.zeros(H, device=device)
dt_bias = torch.zeros(H * D, device=device)
# Kimi K3: l2norm, the safe gate (lower bound -5) and the beta sigmoid all inside the op.
in_kernel = dict(
    use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=True,
    use_beta_sigmoid_in_kernel=True,
    A_log=A_log,
    dt_bias=dt_bias,
    lower_bound=-5.0,
)


def layer_core(q, k, v, g, beta_logits, norm_gate, norm_weight):
    """Prefill T tokens with the chunk op, decode one more with the recurrent op, then the
    gated RMSNorm of Kimi's output path. Returns the normed output and the fp32 state."""
    o, state = kda_ops.chunk_kda(
        q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta_logits[:, :-1],
        output_final_state=True, **in_kernel,
    )  # fmt: skip
    o_next, state = kda_ops.fused_recurrent_kda(
        q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta_logits[:, -1:],
        initial_state=state, output_final_state=True, **in_kernel,
    )  # fmt: skip
    o = torch.cat([o, o_next], dim=1)
    return kda_ops.gated_rms_norm(o, norm_gate, norm_weight, activation="sigmoid"), state


norm_gate = torch.randn_like(v)
norm_weight = torch.ones(D, device=device)
inputs = (q, k, v, g, beta_logits, norm_gate, norm_weight)

out, state = layer_core(*inputs)
print(
    f"device={device} out {tuple(out.shape)} {out.dtype}, state {tuple(state.shape)} {state.dtype}"
)

# The chunk form and the token recurrence are the same math.
o_chunk, _ = kda_ops.chunk_kda(q, k, v, g, beta_logits, **in_kernel)
o_recurrent, _ = kda_ops.fused_recurrent_kda(q, k, v, g, beta_logits, **in_kernel)
error = ((o_chunk.float() - o_recurrent.float()).norm() / o_recurrent.float().norm()).item()
print(f"chunk vs recurrent relative error: {error:.2e}")
assert error < 1e-2

# One graph, no breaks: the ops are torch.library ops with fake kernels.
compiled = torch.compile(layer_core, fullgraph=True)
out_compiled, state_compiled = compiled(*inputs)
torch.testing.assert_close(out_compiled, out, rtol=2e-2, atol=2e-2)
torch.testing.assert_close(state_compiled, state, rtol=1e-3, atol=1e-3)
print("torch.compile(fullgraph=True): matches eager")


class LayerCore(torch.nn.Module):
    def forward(self, *tensors):
        return layer_core(*tensors)


# torch.export keeps the kda ops, with the state as an explicit output and a dynamic T.
length = torch.export.Dim("T", min=3, max=8192)
program = torch.export.export(LayerCore(), inputs, dynamic_shapes=(({1: length},) * 6 + (None,),))
kda_nodes = sorted(
    str(node.target) for node in program.graph.nodes if str(node.target).startswith("kda.")
)
print("torch.export nodes:", kda_nodes)
shorter = (*(t[:, :50] for t in inputs[:6]), norm_weight)
torch.testing.assert_close(program.module()(*shorter)[0], layer_core(*shorter)[0])
print("exported program matches eager at T = 50")
