"""Context parallelism over gloo (2 and 4 spawned CPU ranks) and NCCL (one rank per GPU) gives
the outputs, final states and gradients of one process running the whole batch (float64),
for fixed length and varlen.
Each rank builds the same seeded inputs, runs its slice through kda_ops.distributed and
checks it against the single-process result it computes itself; a failed check fails the
spawn."""

import os
import time
from datetime import timedelta
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kda_ops
from kda_ops.distributed import (
    ShardSequences,
    all_gather_stacked,
    causal_conv1d_cp,
    chunk_kda_cp,
    shard_sequences,
)
from tests.kda_ops.inputs import delta_rule_inputs
from tests.sweeps import sweep

TIMEOUT_S = 150
IN_KERNEL = {
    "use_qk_l2norm_in_kernel": True,
    "use_gate_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
    "lower_bound": -5.0,
}
# Global offsets of T = 40 packed tokens; ranks hold [0, 20, 40] (2) or [0, 10, 20, 30, 40]
# (4). With 4 ranks: A's [3, 25) crosses 2 boundaries (rank 1 is one piece of it) and rank 2
# holds 3 pieces, the first continuing [3, 25), the last [28, 33) crossing into rank 3; B's
# [7, 38) crosses 3; C's [9, 20) and [27, 40) start 1 and 3 = W - 1 tokens before a
# boundary (the conv halo mixes the initial conv state in) and 20 is a sequence start.
# With 2 ranks: A and B cross 20 once, C starts there.
VARLEN = {"A": [0, 3, 25, 28, 33, 40], "B": [0, 7, 38, 40], "C": [0, 9, 20, 27, 40]}
VARLEN_INPUTS = {"length": 40, "heads": 2, "value_heads": 4, "raw_gate": True}
CASES = {  # name: (delta_rule_inputs kwargs, chunk_kda kwargs besides the tensors, cu_seqlens)
    "kda_in_kernel": (
        {"batch": 2, "length": 45, "heads": 2, "value_heads": 4, "raw_gate": True},
        IN_KERNEL,
        None,
    ),
    "gdn_plain": ({"length": 37, "scalar_gate": True}, {}, None),
    **{
        f"kda_varlen_{name}": (dict(VARLEN_INPUTS, n_seqs=len(cuts) - 1), IN_KERNEL, cuts)
        for name, cuts in VARLEN.items()
    },
    "gdn_varlen_B": ({"length": 40, "scalar_gate": True, "n_seqs": 3}, {}, VARLEN["B"]),
}


def _bounds(length: int, world: int, rank: int) -> slice:
    """Uneven split: rank r holds tokens [r * T // CP, (r + 1) * T // CP)."""
    return slice(rank * length // world, (rank + 1) * length // world)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x)
    return x


def _ending(cuts: list[int], local: slice) -> list[int]:
    """The sequences ending in the rank's slice: the final states it returns."""
    return [i for i in range(len(cuts) - 1) if local.start < cuts[i + 1] <= local.stop]


def _check_delta_rule(name: str, rank: int, world: int) -> None:
    input_kwargs, options, cuts = CASES[name]
    x = delta_rule_inputs(requires_grad=True, **input_kwargs)
    gate = {"A_log": x.A_log, "dt_bias": x.dt_bias} if options else {}
    varlen = {} if cuts is None else {"cu_seqlens": torch.tensor(cuts)}
    tensors = (x.q, x.k, x.v, x.g, x.beta)
    kwargs = dict(options, **gate, **varlen, initial_state=x.initial_state, output_final_state=True)
    grad_o = torch.randn_like(x.v)
    grad_state = torch.randn_like(x.initial_state)
    local = _bounds(x.q.shape[1], world, rank)

    o, state = kda_ops.chunk_kda(*tensors, **kwargs)
    loss = (o * grad_o).sum() + (state * grad_state).sum()
    want = torch.autograd.grad(loss, x.tensors(), allow_unused=True, materialize_grads=True)
    if cuts is None:  # the state after the rank's last token; the final one on the last rank
        _, state_here = kda_ops.chunk_kda(*(t[:, : local.stop] for t in tensors), **kwargs)
        state_grad = grad_state * (rank == world - 1)
    else:
        ending = _ending(cuts, local)
        state_here, state_grad = state[ending], grad_state[ending]

    o_cp, state_cp = chunk_kda_cp(*(t[:, local] for t in tensors), **kwargs)
    torch.testing.assert_close(o_cp, o[:, local], msg=f"{name}: output")
    torch.testing.assert_close(state_cp, state_here, msg=f"{name}: final states on the rank")
    loss = (o_cp * grad_o[:, local]).sum() + (state_cp * state_grad).sum()
    got = torch.autograd.grad(loss, x.tensors(), allow_unused=True, materialize_grads=True)
    # Each rank's gradients cover its slice of the token tensors and its share of the
    # parameters and the initial state: summed over ranks (as DDP would) they are the whole.
    for i, (g_cp, g_ref) in enumerate(zip(got, want)):
        torch.testing.assert_close(_all_reduce(g_cp), g_ref, msg=f"{name}: gradient {i}")

    if cuts is None:  # Bypassing the composition, the plain sum of zero-state end states is wrong.
        zero_state_ends = all_gather_stacked(kda_ops.chunk_kda(
            *(t[:, local].detach() for t in tensors), **dict(kwargs, initial_state=None)
        )[1], None)  # fmt: skip
        assert not torch.allclose(zero_state_ends.sum(0), state.detach(), atol=1e-3)


def _check_conv_halo(rank: int, world: int, cuts: Optional[list[int]]) -> None:
    batch, length, dim, width = (2, 13, 6, 4) if cuts is None else (1, cuts[-1], 6, 4)
    n_seqs = batch if cuts is None else len(cuts) - 1
    x = torch.randn(batch, length, dim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(dim, width, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(dim, dtype=torch.float64, requires_grad=True)
    start = torch.randn(n_seqs, dim, width - 1, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(batch, length, dim, dtype=torch.float64)
    grad_state = torch.randn(n_seqs, dim, width - 1, dtype=torch.float64)
    leaves = (x, weight, bias, start)
    varlen = {} if cuts is None else {"cu_seqlens": torch.tensor(cuts)}
    y, state = kda_ops.causal_conv1d(x, weight, bias, start, **varlen)
    loss = (y * grad_y).sum() + (state * grad_state).sum()
    want = torch.autograd.grad(loss, leaves)
    local = _bounds(length, world, rank)
    if cuts is None:
        _, state_here = kda_ops.causal_conv1d(x[:, : local.stop], weight, bias, start)
        state_grad = grad_state * (rank == world - 1)
    else:
        ending = _ending(cuts, local)
        state_here, state_grad = state[ending], grad_state[ending]

    y_cp, state_cp = causal_conv1d_cp(x[:, local], weight, bias, start, **varlen)
    torch.testing.assert_close(y_cp, y[:, local], msg=f"conv {cuts}: output")
    torch.testing.assert_close(state_cp, state_here, msg=f"conv {cuts}: final states")
    loss = (y_cp * grad_y[:, local]).sum() + (state_cp * state_grad).sum()
    got = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    for name, g_cp, g_ref in zip(("x", "weight", "bias", "initial_state"), got, want):
        torch.testing.assert_close(_all_reduce(g_cp), g_ref, msg=f"conv {cuts}: gradient of {name}")


def _worker(rank: int, world: int, store: str, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":  # every tensor the checks create lives on the rank's own GPU
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    try:
        for name in CASES:
            torch.manual_seed(0)  # the same inputs on every rank
            _check_delta_rule(name, rank, world)
        for cuts in (None, *VARLEN.values()):
            torch.manual_seed(1)
            _check_conv_halo(rank, world, cuts)
        dist.barrier()  # no rank tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # Every check passed and the group is down: skip the interpreter's finalization, where
    # gloo's threads can still abort a rank after the fact ("terminate called without an
    # active exception" after every rank printed past destroy_process_group: 2 runs in 60
    # with 4 ranks on 2 cores). A failed check raises before this line, and the spawn
    # wrapper reports it.
    os._exit(0)


def _spawn(world: int, store: str, backend: str) -> None:
    context = mp.start_processes(
        _worker, args=(world, store, backend), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} {backend} ranks did not finish in {TIMEOUT_S} s")


@pytest.mark.parametrize("world", sweep([2, 4], keep=[(2,)]))
def test_context_parallel_matches_one_process(world, tmp_path):
    _spawn(world, str(tmp_path / "store"), "gloo")


@pytest.mark.gpu
def test_context_parallel_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL context parallelism needs two GPUs on one host")
    _spawn(torch.cuda.device_count(), str(tmp_path / "store"), "nccl")


@pytest.mark.parametrize(
    ("rank", "want"),
    [
        (0, ShardSequences((0, 3, 10), first=0, continues_in=False, continues_out=True)),
        (1, ShardSequences((0, 10), first=1, continues_in=True, continues_out=True)),
        (2, ShardSequences((0, 5, 8, 10), first=1, continues_in=True, continues_out=True)),
        (3, ShardSequences((0, 3, 10), first=3, continues_in=True, continues_out=False)),
    ],
)
def test_shard_sequences(rank, want):
    got = shard_sequences(VARLEN["A"], 10 * rank, 10 * rank + 10)
    assert got == want
    assert list(got.ending) == _ending(VARLEN["A"], _bounds(40, 4, rank))


@pytest.fixture
def one_rank(tmp_path):
    """A gloo group of this process alone."""
    store = tmp_path / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_varlen_on_one_rank_is_the_plain_op(one_rank):
    x = delta_rule_inputs(length=12, n_seqs=3)
    kwargs = {"initial_state": x.initial_state, "output_final_state": True,
              "cu_seqlens": torch.tensor([0, 5, 6, 12])}  # fmt: skip
    tensors = (x.q, x.k, x.v, x.g, x.beta)
    for got, want in zip(chunk_kda_cp(*tensors, **kwargs), kda_ops.chunk_kda(*tensors, **kwargs)):
        torch.testing.assert_close(got, want)
    conv = (x.v[..., 0, :], torch.randn(4, 4, dtype=torch.float64))
    for got, want in zip(
        causal_conv1d_cp(*conv, cu_seqlens=kwargs["cu_seqlens"]),
        kda_ops.causal_conv1d(*conv, cu_seqlens=kwargs["cu_seqlens"]),
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("function", [chunk_kda_cp, causal_conv1d_cp])
@pytest.mark.parametrize(
    ("cu_seqlens", "error", "match"),
    [
        ([0, 3, 9], ValueError, r"`cu_seqlens` must be the global offsets"),
        ([0, 3, 3, 8], ValueError, r"`cu_seqlens` must be the global offsets"),
        ([1, 3, 8], ValueError, r"`cu_seqlens` must be the global offsets"),
        ([[0, 3, 8]], ValueError, r"`cu_seqlens` must be 1-D"),
    ],
)
def test_bad_varlen_is_rejected(one_rank, function, cu_seqlens, error, match):
    x = delta_rule_inputs(length=8)
    args = (
        (x.q, x.k, x.v, x.g, x.beta)
        if function is chunk_kda_cp
        else (x.v[..., 0, :], torch.ones(2, 4, dtype=torch.float64))
    )
    with pytest.raises(error, match=match):
        function(*args, cu_seqlens=torch.tensor(cu_seqlens))


@pytest.mark.parametrize("function", [chunk_kda_cp, causal_conv1d_cp])
def test_varlen_needs_one_row(one_rank, function):
    x = delta_rule_inputs(batch=2, length=8)
    args = (
        (x.q, x.k, x.v, x.g, x.beta)
        if function is chunk_kda_cp
        else (x.v[..., 0, :], torch.ones(2, 4, dtype=torch.float64))
    )
    with pytest.raises(ValueError, match=r"batch size must be 1"):
        function(*args, cu_seqlens=torch.tensor([0, 3, 8]))
