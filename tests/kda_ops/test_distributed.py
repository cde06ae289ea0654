"""Context parallelism over gloo: 2 and 4 spawned ranks give the outputs, end states and
gradients of one process running the whole sequence (float64). Each rank builds the same
seeded inputs, runs its slice through kda_ops.distributed and checks it against the
single-process result it computes itself; a failed check fails the spawn."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kda_ops
from kda_ops.distributed import all_gather_stacked, causal_conv1d_cp, chunk_kda_cp
from tests.kda_ops.inputs import delta_rule_inputs

TIMEOUT_S = 150
CASES = {  # name: (delta_rule_inputs kwargs, chunk_kda kwargs besides the tensors)
    "kda_in_kernel": (
        {"batch": 2, "length": 45, "heads": 2, "value_heads": 4, "raw_gate": True},
        {
            "use_qk_l2norm_in_kernel": True,
            "use_gate_in_kernel": True,
            "use_beta_sigmoid_in_kernel": True,
            "lower_bound": -5.0,
        },
    ),
    "gdn_plain": ({"length": 37, "scalar_gate": True}, {}),
}


def _bounds(length: int, world: int, rank: int) -> slice:
    """Uneven split: rank r holds tokens [r * T // CP, (r + 1) * T // CP)."""
    return slice(rank * length // world, (rank + 1) * length // world)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x)
    return x


def _check_delta_rule(name: str, rank: int, world: int) -> None:
    input_kwargs, options = CASES[name]
    x = delta_rule_inputs(requires_grad=True, **input_kwargs)
    gate = {"A_log": x.A_log, "dt_bias": x.dt_bias} if options else {}
    tensors = (x.q, x.k, x.v, x.g, x.beta)
    kwargs = dict(options, **gate, initial_state=x.initial_state, output_final_state=True)
    grad_o = torch.randn_like(x.v)
    grad_state = torch.randn_like(x.initial_state)
    local = _bounds(x.q.shape[1], world, rank)
    last = rank == world - 1

    o, state = kda_ops.chunk_kda(*tensors, **kwargs)
    _, state_here = kda_ops.chunk_kda(*(t[:, : local.stop] for t in tensors), **kwargs)
    loss = (o * grad_o).sum() + (state * grad_state).sum()
    want = torch.autograd.grad(loss, x.tensors(), allow_unused=True, materialize_grads=True)

    o_cp, state_cp = chunk_kda_cp(*(t[:, local] for t in tensors), **kwargs)
    torch.testing.assert_close(o_cp, o[:, local], msg=f"{name}: output")
    torch.testing.assert_close(state_cp, state_here, msg=f"{name}: end state of the rank")
    loss = (o_cp * grad_o[:, local]).sum() + (state_cp * grad_state).sum() * last
    got = torch.autograd.grad(loss, x.tensors(), allow_unused=True, materialize_grads=True)
    # Each rank's gradients cover its slice of the token tensors and its share of the
    # parameters and the initial state: summed over ranks (as DDP would) they are the whole.
    for i, (g_cp, g_ref) in enumerate(zip(got, want)):
        torch.testing.assert_close(_all_reduce(g_cp), g_ref, msg=f"{name}: gradient {i}")

    # Bypassing the composition, the plain sum of zero-state end states is wrong.
    zero_state_ends = all_gather_stacked(kda_ops.chunk_kda(
        *(t[:, local].detach() for t in tensors), **dict(kwargs, initial_state=None)
    )[1], None)  # fmt: skip
    assert not torch.allclose(zero_state_ends.sum(0), state.detach(), atol=1e-3)


def _check_conv_halo(rank: int, world: int) -> None:
    batch, length, dim, width = 2, 13, 6, 4
    x = torch.randn(batch, length, dim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(dim, width, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(dim, dtype=torch.float64, requires_grad=True)
    start = torch.randn(batch, dim, width - 1, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(batch, length, dim, dtype=torch.float64)
    leaves = (x, weight, bias, start)
    y, _ = kda_ops.causal_conv1d(x, weight, bias, start)
    want = torch.autograd.grad((y * grad_y).sum(), leaves)
    local = _bounds(length, world, rank)
    _, state_here = kda_ops.causal_conv1d(x[:, : local.stop], weight, bias, start)

    y_cp, state_cp = causal_conv1d_cp(x[:, local], weight, bias, start)
    torch.testing.assert_close(y_cp, y[:, local], msg="conv: output")
    torch.testing.assert_close(state_cp, state_here, msg="conv: end state")
    got = torch.autograd.grad((y_cp * grad_y[:, local]).sum(), leaves, allow_unused=True,
                              materialize_grads=True)  # fmt: skip
    for name, g_cp, g_ref in zip(("x", "weight", "bias", "initial_state"), got, want):
        torch.testing.assert_close(_all_reduce(g_cp), g_ref, msg=f"conv: gradient of {name}")


def _worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    try:
        for name in CASES:
            torch.manual_seed(0)  # the same inputs on every rank
            _check_delta_rule(name, rank, world)
        torch.manual_seed(1)
        _check_conv_halo(rank, world)
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_process(world, tmp_path):
    context = mp.start_processes(
        _worker, args=(world, str(tmp_path / "store")), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} gloo ranks did not finish in {TIMEOUT_S} s")


@pytest.mark.parametrize("function", [chunk_kda_cp, causal_conv1d_cp])
def test_varlen_is_rejected(function):
    x = delta_rule_inputs(length=8)
    cu_seqlens = torch.tensor([0, 3, 8])
    args = (
        (x.q, x.k, x.v, x.g, x.beta)
        if function is chunk_kda_cp
        else (x.v[..., 0, :], torch.ones(4, 4))
    )
    with pytest.raises(ValueError, match=r"`cu_seqlens` \(varlen\) is not supported"):
        function(*args, cu_seqlens=cu_seqlens)
