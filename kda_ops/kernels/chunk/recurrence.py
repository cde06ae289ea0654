"""The forward's head-parallel recurrence kernel, ``chunk_recurrence_kernel`` (a program a
value block of a sequence-head, ``value_block_program``), and its launch over a set of
sequences.

Over the prepare kernel's outputs (``prepare.py``) it walks a sequence's chunks, a step
of ``STEP`` tokens each (the prepare's chunk: 16 in the forward, 64 for the training
forward's chunk states), with the fp32 state S in registers: ``v_new = u - w S``,
``o = qg S + Aqk v_new``, ``S = diag(Γ_C) S + kdᵀ v_new``. Chunk states are written to
memory only when asked (``STORE_CHUNK_STATES``: the state at each 64-token chunk start,
what a prefix cache stores and what the backward reads, ``[n_chunks, HV, K, V]`` at the
chunk's global number, every ``64 // STEP``-th step). Extra state columns past V
(``WIDTH``) carry the transition map that ``segments.py`` composes. With ``WINDOW_STEPS``
a launch walks steps ``[window_begin, window_begin + WINDOW_STEPS)`` of each sequence
only, from the state in ``initial_state`` (the previous window's ``final_state``, the same
buffer): the pipelined forward's time windows (``pipeline.py``); a step's number is the
sequence's, so each chunk state is stored once, in the window holding its step.

A sequence's steps but its partial last one need no row mask: with
``UNMASKED_FULL_STEPS`` (``unmasked_full_steps``: 16-bit inputs, 16-token steps) they run
in a loop of their own, which drops the masks' address and predicate instructions, and the
partial step after it.

At 16-token steps a program takes under 256 registers at 4 warps and a quarter of the
64-token step's shared memory, so two share an SM (``scan_residency``): at H = 96 all 192
programs of 64 value columns run in one wave."""

import triton
import triton.language as tl

from kda_ops.kernels.chunk.device import CHUNK, scan_program, sequence_span, value_block_program
from kda_ops.kernels.chunk.planning import dot_block, scan_plan, scan_warps
from kda_ops.kernels.fast_exp import fast_exp
from kda_ops.kernels.launches import KernelLaunch
from kda_ops.kernels.sizes import DeviceSizes, cdiv
from kda_ops.reference import chunk_offsets as sequence_chunk_offsets
from kda_ops.reference import longest_first


# A length of 1, specialized, takes more shared memory (fp32, K = 256: 245760 bytes
# against 212992) than Hopper has; the launch planning assumes an unspecialized length.
@triton.jit(do_not_specialize=["length"])
def chunk_recurrence_kernel(
    w,
    u,
    qg,
    kd,
    aqk,
    chunk_decay,
    initial_state,
    cu_seqlens,
    chunk_offsets,
    state_chunks,
    sequence_order,
    length,
    first_head,
    window_begin,
    o,
    final_state,
    chunk_states,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    WIDTH: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    STEP: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr,
    STORE_OUTPUT: tl.constexpr,
    STAGES: tl.constexpr,
    WINDOW_STEPS: tl.constexpr,
    UNMASKED_FULL_STEPS: tl.constexpr,
):
    i_v, i_rank = value_block_program(WIDTH, BV)
    i_n, i_hv, i_nh = scan_program(
        i_rank=first_head + i_rank, sequence_order=sequence_order, HV=HV, IS_VARLEN=IS_VARLEN
    )
    bos, seq_len, first_step = sequence_span(
        i_n=i_n,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        length=length,
        IS_VARLEN=IS_VARLEN,
        C=STEP,
    )
    steps_begin = 0
    steps_end = tl.cdiv(seq_len, STEP)
    if WINDOW_STEPS > 0:  # a time window: the state comes in and goes out through memory
        if window_begin > 0 and window_begin >= steps_end:
            return  # the sequence ended in an earlier window, which stored its state
        steps_begin = window_begin
        steps_end = tl.minimum(steps_end, window_begin + WINDOW_STEPS)
    # Chunk states are the states at 64-token chunk starts, every STEPS_A_CHUNK-th step.
    STEPS_A_CHUNK: tl.constexpr = 64 // STEP
    if STEPS_A_CHUNK == 1:
        first_chunk = first_step
    else:
        _, _, first_chunk = sequence_span(
            i_n=i_n,
            cu_seqlens=cu_seqlens,
            chunk_offsets=state_chunks,
            length=length,
            IS_VARLEN=IS_VARLEN,
        )
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V  # value columns (u, o)
    mask_s = offs_v < WIDTH  # state columns
    dot_dtype = qg.dtype.element_ty

    tile_offsets = offs_k[:, None] * WIDTH + offs_v[None, :]  # within one [K, WIDTH] state
    state_offsets = i_nh.to(tl.int64) * K * WIDTH + tile_offsets
    state_mask = mask_k[:, None] & mask_s[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL_STATE:
        state = tl.load(initial_state + state_offsets, mask=state_mask, other=0.0)
    if WIDTH > V:  # transition columns: u = 0 and the identity as the state coming in
        state += tl.where(offs_k[:, None] == offs_v[None, :] - V, 1.0, 0.0)

    rows = tl.arange(0, STEP)
    # With UNMASKED_FULL_STEPS, a loop over the steps inside the sequence, without row
    # masks, then the partial last step, masked; else one loop, masked.
    full_end = tl.maximum(tl.minimum(steps_end, seq_len // STEP), steps_begin)
    MASKED_STAGES: tl.constexpr = 1 if UNMASKED_FULL_STEPS else STAGES
    if not UNMASKED_FULL_STEPS:
        full_end = steps_begin
    for partial in tl.static_range(0 if UNMASKED_FULL_STEPS else 1, 2):
        first = full_end if partial else steps_begin
        last = steps_end if partial else full_end
        for c in tl.range(first, last, num_stages=MASKED_STAGES if partial else STAGES):
            tokens = bos + c * STEP + rows
            in_seq = (c * STEP + rows < seq_len) if partial else rows < STEP
            token_offsets = (tokens * HV + i_hv)[:, None]
            mask_rows_k = in_seq[:, None] & mask_k[None, :]
            mask_rows_v = in_seq[:, None] & mask_v[None, :]
            mask_rows_s = in_seq[:, None] & mask_s[None, :]
            b_w = tl.load(w + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
            b_qg = tl.load(qg + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
            b_kd = tl.load(kd + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
            b_u = tl.load(u + token_offsets * V + offs_v[None, :], mask=mask_rows_v, other=0.0)
            chunk_id = (first_step + c).to(tl.int64) * HV + i_hv
            if STORE_CHUNK_STATES:  # noqa: SIM102 (a constexpr, then a tensor condition)
                if c % STEPS_A_CHUNK == 0:  # the state entering a chunk
                    state_id = (first_chunk + c // STEPS_A_CHUNK).to(tl.int64) * HV + i_hv
                    tl.store(
                        chunk_states + state_id * K * WIDTH + tile_offsets,
                        state.to(chunk_states.dtype.element_ty),
                        mask=state_mask,
                    )
            b_aqk = tl.load(aqk + (chunk_id * STEP + rows)[:, None] * STEP + rows[None, :])
            # Blocks above the diagonal are never written (no zero-filled buffer needed).
            b_aqk = tl.where(rows[:, None] >= rows[None, :], b_aqk, 0.0)
            decay_last = fast_exp(
                tl.load(chunk_decay + chunk_id * K + offs_k, mask=mask_k, other=0.0)
            )

            b_state = state.to(dot_dtype)
            v_new = b_u.to(tl.float32) - tl.dot(
                b_w.to(dot_dtype), b_state, input_precision=DOT_PRECISION
            )
            v_new = tl.where(mask_rows_s, v_new, 0.0).to(dot_dtype)
            if STORE_OUTPUT:
                b_o = tl.dot(b_qg.to(dot_dtype), b_state, input_precision=DOT_PRECISION)
                b_o += tl.dot(b_aqk.to(dot_dtype), v_new, input_precision=DOT_PRECISION)
                tl.store(
                    o + token_offsets * V + offs_v[None, :],
                    b_o.to(o.dtype.element_ty),
                    mask=mask_rows_v,
                )
            state = state * decay_last[:, None] + tl.dot(
                tl.trans(b_kd.to(dot_dtype)), v_new, input_precision=DOT_PRECISION
            )
    tl.store(final_state + state_offsets, state, mask=state_mask)


def unmasked_full_steps(precision: str, step: int) -> bool:
    """Whether the recurrence runs a sequence's full steps in a loop without row masks
    (the kernel's ``UNMASKED_FULL_STEPS``): with 16-bit inputs in the inference forward's
    16-token steps, whose step it shortens by a tenth of its instructions (sm_90, Triton
    3.6: 394 to 350 a warp at 64 value columns). Not with fp32 inputs (``precision``
    "ieee"): their FMA dots spill, and two copies of the loop spill more. Not in the
    training forward's 64-token steps: on the GPU, at 32 value columns, they gave a wrong o
    after a partial last step (the note below), where the interpreter gives the masked
    loop's bits."""
    return precision != "ieee" and step < CHUNK


# Found with ``tools/recurrence_probe.py`` on an H100 (Triton 3.6, bf16;
# ``benchmarks/results/recurrence_probe_h100.jsonl``, ``recurrence_probe_64_steps_h100.log``):
# in 64-token steps at 32 value columns the unmasked loop is wrong once a partial step follows
# it, and past 128 key columns the masked loop is wrong or reads out of bounds; racecheck saw
# no shared-memory hazard. A kernel of this loop with no kda_ops code
# (``tools/triton_repro_32cols.py``, ``benchmarks/results/triton_repro_32cols_h100.log``) is
# wrong the same way: at 32 columns with one stage and in the unmasked loop, at 16 columns
# with 4 warps likewise; 64 columns exact everywhere. A Triton bug, then. No production
# launch takes those settings: 64-token steps take the masked loop with 2 or 3 stages, and
# past 128 key columns in 16 bits 16 or 64 columns at 8 warps (``scan_column_splits``).
# The same family (several dots, 16- or 32-wide tiles, 4 warps, Hopper, Triton >= 3.6) is
# triton-lang/triton#11366, which FLA guards against as a ptxas miscompile; FLA found ptxas
# 12.8.93, the one Triton 3.6 bundles, generating wrong shared-memory addresses where 13.1
# assembles the same PTX correctly (fla-org/flash-linear-attention#1262). So it is here: with
# CUDA 13.4's ptxas the repro is exact wherever it fits shared memory, with the bundled one not
# (``benchmarks/results/triton_repro_32cols_ptxas_h100.log``).


def recurrence_launches(
    intermediates,
    initial_state,
    cu_seqlens,
    chunk_offsets,
    length,
    o,
    final_state,
    chunk_states,
    precision,
    window: tuple[int, int] = (0, 0),
    *,
    target: DeviceSizes | None = None,
) -> list[KernelLaunch]:
    """The launches of ``chunk_recurrence_kernel`` over the sequences of ``final_state``
    (``[N, HV, K, width]``; ``width`` > V adds transition columns, see the kernel). With a
    symbolic sequence count (a graph traced for any batch) one launch at the value columns
    of a batch that fills the SMs: the split of value columns and of waves
    (``scan_plan``) compares the count with the SM count. Packed
    sequences are taken longest first (``longest_first``). ``window``: (first step, steps)
    of a time window (the kernel's ``WINDOW_STEPS``), or (0, 0): whole sequences.
    ``target``: the device to plan for, if not the tensors' (``scan_plan``)."""
    w, u, qg, kd, aqk, chunk_decay = intermediates
    step = aqk.shape[-1]  # tokens a step: the prepare's chunk
    state_chunks = chunk_offsets  # chunk_offsets of the 64-token chunks of the states
    sequence_order = None if cu_seqlens is None else longest_first(cu_seqlens)
    if step != CHUNK and chunk_states is not None and cu_seqlens is not None:
        state_chunks = sequence_chunk_offsets(cu_seqlens, CHUNK)
    n_seqs, value_heads, head_k, state_width = final_state.shape
    head_v = u.shape[-1]
    block_k, block_v = dot_block(head_k), dot_block(state_width)
    launches = scan_plan(
        block_k=block_k,
        block_v=block_v,
        sequence_heads=n_seqs * value_heads,
        device=u.device,
        itemsize=w.element_size(),
        aqk_itemsize=aqk.element_size(),
        store_output=o is not None,
        warps=scan_warps(block_k),
        rows=step,
        target=target,
    )
    written = {"o": o, "final_state": final_state, "chunk_states": chunk_states}
    writes = tuple(name for name, tensor in written.items() if tensor is not None)
    return [
        KernelLaunch(
            kernel=chunk_recurrence_kernel,
            grid=(cdiv(state_width, split_v) * heads,),
            args=dict(
                w=w,
                u=u,
                qg=qg,
                kd=kd,
                aqk=aqk,
                chunk_decay=chunk_decay,
                initial_state=initial_state,
                cu_seqlens=cu_seqlens,
                chunk_offsets=chunk_offsets,
                state_chunks=state_chunks,
                sequence_order=sequence_order,
                length=length,
                first_head=first_head,
                window_begin=window[0],
                o=o,
                final_state=final_state,
                chunk_states=chunk_states,
                HV=value_heads,
                K=head_k,
                V=head_v,
                WIDTH=state_width,
                BK=block_k,
                BV=split_v,
                STEP=step,
                HAS_INITIAL_STATE=initial_state is not None,
                IS_VARLEN=cu_seqlens is not None,
                DOT_PRECISION=precision,
                STORE_CHUNK_STATES=chunk_states is not None,
                STORE_OUTPUT=o is not None,
                STAGES=stages,
                WINDOW_STEPS=window[1],
                UNMASKED_FULL_STEPS=unmasked_full_steps(precision, step),
                num_warps=scan_warps(block_k),
            ),
            writes=writes,
        )
        for first_head, heads, split_v, stages in launches
    ]


def launch_recurrence(**arguments: object) -> None:
    """Run :func:`recurrence_launches` (same arguments, by name)."""
    for launch in recurrence_launches(**arguments):
        launch.run()
