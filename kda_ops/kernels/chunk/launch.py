"""The chunked forward's launcher: the prepare kernel (once with the safe gate, else its
bounded and unbounded launches; ``prepare.py``), then the recurrence over the chunks
(``recurrence.py``), in one scan per sequence, in segments (``segments.py``) or, for long
sequences, both in time windows on two streams (``pipeline.py``).

The prepare's chunks and the recurrence's steps are ``FORWARD_CHUNK`` = 16 tokens (the
package docstring says why). Varlen needs no host sync: chunks are numbered per sequence on
the device (``chunk_offsets``) and the grid is the upper bound ``T // C + N``; programs
past the last chunk exit."""

from typing import Optional

import torch
from torch import Tensor

from kda_ops import arguments
from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.chunk.device import BLOCK, CHUNK
from kda_ops.kernels.chunk.pipeline import PrepareStep, run_pipelined
from kda_ops.kernels.chunk.planning import (
    dot_block,
    forward_chunk,
    pipeline_window_steps,
    prepare_flags,
    prepare_warps,
    single_prepare_pass,
)
from kda_ops.kernels.chunk.recurrence import launch_recurrence, recurrence_launches
from kda_ops.kernels.chunk.segments import recurrence_segments, segmented_recurrence
from kda_ops.kernels.launches import LaunchPlan
from kda_ops.kernels.sizes import DeviceSizes, next_power_of_2
from kda_ops.reference import chunk_offsets as sequence_chunk_offsets
from kda_ops.reference import chunk_state_rows
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions


def chunk_plan(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    chunk_states: Optional[Tensor] = None,
    output: bool = True,
    chunk: int = FORWARD_CHUNK,
    *,
    target: Optional[DeviceSizes] = None,
    single_prepare_launch: bool = False,
) -> LaunchPlan:
    """The chunked forward as launches, the recurrence in one serial scan per sequence:
    the prepare kernel's, then :func:`recurrence_launches`. Results ``"o"`` and
    ``"final_state"``; :func:`launch_chunk_kda` says what they hold and what the arguments
    are. Plans from symbolic shapes too (a traced graph). ``target``: the device to plan
    for, if not the tensors' (an ahead-of-time build's); ``single_prepare_launch``: as
    :func:`plan_prepare`'s ``single_launch``."""
    prepare = plan_prepare(
        inputs=inputs,
        cu_seqlens=cu_seqlens,
        options=options,
        chunk=chunk,
        single_launch=single_prepare_launch,
    )
    o, final_state, initial_state = _outputs(
        inputs=inputs, initial_state=initial_state, cu_seqlens=cu_seqlens, output=output
    )
    launches = prepare.launches() + recurrence_launches(
        intermediates=prepare.intermediates,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        chunk_offsets=prepare.chunk_offsets,
        length=inputs.q.shape[1],
        o=o,
        final_state=final_state,
        chunk_states=chunk_states,
        precision=prepare.precision,
        target=target,
    )
    return LaunchPlan(tuple(launches), {"o": o, "final_state": final_state})


def launch_chunk_kda(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    chunk_states: Optional[Tensor] = None,
    output: bool = True,
    segments: Optional[int] = None,
    window_steps: Optional[int] = None,
    chunk: Optional[int] = None,
) -> tuple[Optional[Tensor], Tensor]:
    """Chunked forward; returns o ``[B, T, HV, V]`` (v's dtype; ``None`` with
    ``output=False``, which skips the output products) and the fp32 final state.
    Arguments as the ``kda::chunk`` op takes them (``kda_ops.signature``); inputs in one
    dtype of fp16 / bf16 / fp32.

    ``chunk_states``: optional contiguous output ``[R, HV, K, V]`` (fp32, or the dot dtype
    where the backward reads them) with
    ``R = chunk_state_rows(B, T, N or None)``, filled with the state at the start of every
    chunk (chunk c of sequence n at row ``n * ceil(T / 64) + c``, or
    ``chunk_offsets(cu_seqlens)[n] + c`` with packed sequences, whose rows past the last
    chunk are left untouched).

    ``segments``: how many segments the recurrence of each sequence runs in
    (``segmented_recurrence``; fixed length with ``T % (64 * segments) == 0``); ``None``
    lets :func:`recurrence_segments` choose from the shapes. ``window_steps``: with one
    segment, the 16-token steps of a time window of the pipelined forward
    (``pipeline.py``; 16-token chunks only), 0 for one pass over the sequences; ``None``
    lets :func:`pipeline_window_steps` choose. ``chunk``: the prepare's chunk and the
    recurrence's step, 16 or 64 tokens; ``None`` lets :func:`forward_chunk` choose."""
    batch, length, value_heads, head_v = inputs.v.shape
    device = inputs.q.device
    # What forward_chunk and recurrence_segments choose from.
    shapes = dict(
        batch=batch,
        length=length,
        value_heads=value_heads,
        head_v=head_v,
        cu_seqlens=cu_seqlens,
        device=device,
    )
    if chunk is None:
        chunk = forward_chunk(**shapes)
    if chunk not in (FORWARD_CHUNK, CHUNK):
        raise ValueError(f"chunk must be {FORWARD_CHUNK} or {CHUNK} tokens, got {chunk}")
    if segments is None:
        segments = recurrence_segments(**shapes)
    if window_steps is None:
        window_steps = pipeline_window_steps(length, cu_seqlens is not None, device)
    if chunk != FORWARD_CHUNK:
        window_steps = 0
    if segments == 1 and window_steps == 0:
        results = chunk_plan(
            inputs=inputs,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            options=options,
            chunk_states=chunk_states,
            output=output,
            chunk=chunk,
        ).run()
        return results["o"], results["final_state"]
    prepare = plan_prepare(inputs=inputs, cu_seqlens=cu_seqlens, options=options, chunk=chunk)
    o, final_state, initial_state = _outputs(
        inputs=inputs, initial_state=initial_state, cu_seqlens=cu_seqlens, output=output
    )
    if segments > 1:
        for launch in prepare.launches():
            launch.run()
        segmented_recurrence(
            intermediates=prepare.intermediates,
            initial_state=initial_state,
            batch=batch,
            length=length,
            segments=segments,
            o=o,
            final_state=final_state,
            chunk_states=chunk_states,
            precision=prepare.precision,
        )
    else:
        run_pipelined(
            prepare=prepare,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            length=length,
            o=o,
            final_state=final_state,
            chunk_states=chunk_states,
            window_steps=window_steps,
        )
    return o, final_state


def plan_prepare(
    inputs: DeltaRuleInputs,
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    chunk: int = FORWARD_CHUNK,
    *,
    single_launch: bool = False,
) -> PrepareStep:
    """The prepare kernel's :class:`PrepareStep` for ``inputs`` in chunks of ``chunk``
    tokens (16 or 64), its intermediates allocated. ``single_launch``: one ``"all"``
    launch whatever the gate, which redoes the chunks its dense pass overflows in the same
    program (``prepare.py``; a single-kernel TensorRT plugin), where the gates without
    :func:`single_prepare_pass` otherwise take a bounded and an unbounded launch."""
    q, k, v, g, beta, A_log, dt_bias = inputs.map_tokens(Tensor.contiguous)
    batch, length, heads, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        n_seqs = batch
        chunk_offsets = None
    else:
        n_seqs = cu_seqlens.shape[0] - 1
        chunk_offsets = sequence_chunk_offsets(cu_seqlens, chunk)
    # An upper bound with packed sequences (no host sync); programs past the end exit.
    n_chunks = chunk_state_rows(
        batch=batch, length=length, n_seqs=None if cu_seqlens is None else n_seqs, chunk_size=chunk
    )
    block_k, block_v = dot_block(head_k), dot_block(head_v)
    flags = prepare_flags(inputs, cu_seqlens, options)
    tokens_shape = (batch, length, value_heads)
    chunk_decay = torch.empty(n_chunks, value_heads, head_k, device=q.device, dtype=torch.float32)
    w, qg, kd = (q.new_empty(*tokens_shape, head_k) for _ in range(3))
    u = q.new_empty(*tokens_shape, head_v)
    aqk = q.new_empty(n_chunks, value_heads, chunk, chunk)
    writes = ("chunk_decay", "w", "u", "qg", "kd", "aqk")
    if single_launch or single_prepare_pass(flags):
        passes, unbounded = ("all",), None
    else:
        passes = ("bounded", "unbounded")
        unbounded = torch.empty(n_chunks, value_heads, device=q.device, dtype=torch.int8)
        writes += ("unbounded",)
    lower_bound = options.lower_bound
    args = dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        scale=options.scale,
        lower_bound=0.0 if lower_bound is None else lower_bound,
        length=length,
        n_seqs=n_seqs,
        chunk_decay=chunk_decay,
        w=w,
        u=u,
        qg=qg,
        kd=kd,
        aqk=aqk,
        unbounded=unbounded,
        H=heads,
        HV=value_heads,
        K=head_k,
        V=head_v,
        BK=block_k,
        BV=block_v,
        # Only packed sequences search their sequence among BN (a fixed length divides).
        BN=1 if cu_seqlens is None else next_power_of_2(n_seqs),
        **flags,
        BLOCKS=chunk // BLOCK.value,
        num_warps=prepare_warps(block_k),
    )
    return PrepareStep(
        args=args,
        passes=passes,
        writes=writes,
        n_chunks=n_chunks,
        n_seqs=n_seqs,
        value_heads=value_heads,
        intermediates=(w, u, qg, kd, aqk, chunk_decay),
        chunk_offsets=chunk_offsets,
        precision=flags["DOT_PRECISION"],
    )


def _outputs(inputs, initial_state, cu_seqlens, output):
    """(o or None, the fp32 final state, the initial state made contiguous)."""
    o = torch.empty_like(inputs.v) if output else None
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return o, arguments.new_final_state(inputs.q, inputs.v, cu_seqlens), initial_state


def scan_chunks(
    intermediates: tuple[Tensor, ...],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    chunk_offsets: Optional[Tensor],
    o: Optional[Tensor],
    final_state: Tensor,
    chunk_states: Optional[Tensor],
    precision: str,
    segments: Optional[int] = None,
) -> None:
    """The head-parallel recurrence over the prepare kernel's ``(w, u, qg, kd, aqk,
    chunk_decay)`` (shapes as ``launch_chunk_kda`` allocates them): writes ``final_state``
    and, when given, the outputs ``o`` and the chunk-start states; ``chunk_offsets`` of
    ``cu_seqlens`` (``sequence_chunk_offsets``). ``segments`` as in ``launch_chunk_kda``."""
    batch, length, value_heads = intermediates[1].shape[:3]
    if segments is None:
        segments = recurrence_segments(
            batch=batch,
            length=length,
            value_heads=value_heads,
            head_v=intermediates[1].shape[3],
            cu_seqlens=cu_seqlens,
            device=final_state.device,
        )
    if segments == 1:
        launch_recurrence(
            intermediates=intermediates,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            chunk_offsets=chunk_offsets,
            length=length,
            o=o,
            final_state=final_state,
            chunk_states=chunk_states,
            precision=precision,
        )
    else:
        segmented_recurrence(
            intermediates=intermediates,
            initial_state=initial_state,
            batch=batch,
            length=length,
            segments=segments,
            o=o,
            final_state=final_state,
            chunk_states=chunk_states,
            precision=precision,
        )
