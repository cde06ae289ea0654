"""The chunked forward in time windows, the recurrence of one window running while the
prepare of the next does (``run_pipelined``).

The prepare kernel is bound by its SMs' shared memory and issue slots, the recurrence by
the latency of its steps (a program an SM uses a fraction of either), so the two fit on
an SM together. Run one after the other, each leaves that room unused; in windows of
each sequence's tokens, window s's recurrence (on a side stream of a higher priority, so
that SMs freed by prepare programs go to it first) starts as soon as window s's
prepare has finished and shares the SMs with window s + 1's prepare. Each window's
recurrence starts from the state the one before left in ``final_state``
(``chunk_recurrence_kernel``'s ``WINDOW_STEPS``); the prepare's windows write the
intermediates of their chunks (``chunk_prepare_kernel``'s ``WINDOW``). Both kernels are
compiled to fewer registers in the windows (``window_registers``), so that an SM holds a
prepare program beside two recurrence programs. Off CUDA (the interpreter) the same
launches run in the same order on one stream."""

import contextlib
import dataclasses
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.chunk.planning import window_registers
from kda_ops.kernels.chunk.prepare import chunk_prepare_kernel
from kda_ops.kernels.chunk.recurrence import recurrence_launches
from kda_ops.kernels.launches import KernelLaunch
from kda_ops.kernels.sizes import cdiv


class PrepareStep(NamedTuple):
    """The prepare kernel's launch arguments over one forward's inputs and the
    intermediates it writes for the recurrence, ``(w, u, qg, kd, aqk, chunk_decay)``;
    :meth:`launches` over every chunk or over a time window of each sequence."""

    args: dict[str, object]
    passes: tuple[str, ...]  # the kernel's CHUNKS of each launch
    writes: tuple[str, ...]
    n_chunks: int  # an upper bound with packed sequences
    n_seqs: int
    value_heads: int
    intermediates: tuple[Tensor, ...]
    chunk_offsets: Optional[Tensor]  # of packed sequences' 16-token chunks
    precision: str

    def launches(self, window: tuple[int, int] = (0, 0)) -> list[KernelLaunch]:
        """Once with the safe gate, else the bounded and the unbounded launch; ``window``:
        (first chunk, chunks) of every sequence (the kernel's ``WINDOW``), or (0, 0):
        every chunk."""
        first, size = window
        varlen = self.chunk_offsets is not None
        programs = self.n_chunks if size == 0 or varlen else self.n_seqs * size
        window_args = dict(window_first=first, WINDOW=size)
        return [
            KernelLaunch(
                kernel=chunk_prepare_kernel,
                grid=(programs, self.value_heads),
                args={**self.args, **window_args, "CHUNKS": chunks},
                writes=self.writes,
            )
            for chunks in self.passes
        ]


def _with_registers(launch: KernelLaunch, registers: Optional[int]) -> KernelLaunch:
    """``launch`` compiled to at most ``registers`` a thread (Triton's ``maxnreg``), or as
    it is (``None``)."""
    if registers is None:
        return launch
    return dataclasses.replace(launch, args={**launch.args, "maxnreg": registers})


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The recurrence's stream on ``device``: one a device, of a priority above the default
    streams' (torch maps -1 into the device's range)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return _SIDE_STREAMS[device]


def run_pipelined(
    prepare: PrepareStep,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    length: int,
    o: Optional[Tensor],
    final_state: Tensor,
    chunk_states: Optional[Tensor],
    window_steps: int,
) -> None:
    """The prepare kernel's launches and the recurrence's, in windows of ``window_steps``
    16-token steps of every sequence, ``length`` tokens (the longest sequence's bound: T,
    or the packed total) in all. Outputs as ``launch_chunk_kda``'s; on CUDA it returns
    with the current stream ordered after every launch."""
    windows = cdiv(cdiv(length, FORWARD_CHUNK), window_steps)
    registers = window_registers(prepare.args["BK"], prepare.precision)
    device = final_state.device
    on_cuda = device.type == "cuda"
    if on_cuda:
        main, side = torch.cuda.current_stream(device), side_stream(device)
        side.wait_stream(main)  # the inputs and the buffers, as the caller left them
    for index in range(windows):
        window = (index * window_steps, window_steps)
        for launch in prepare.launches(window):
            # The dyadic launch's few chunks take every register: left uncapped.
            capped = registers and launch.args["CHUNKS"] != "unbounded"
            _with_registers(launch, registers[0] if capped else None).run()
        scan = contextlib.nullcontext()
        if on_cuda:
            prepared = torch.cuda.Event()
            prepared.record(main)
            side.wait_event(prepared)
            scan = torch.cuda.stream(side)
        state_in = initial_state if index == 0 else final_state
        with scan:
            for launch in recurrence_launches(
                intermediates=prepare.intermediates,
                initial_state=state_in,
                cu_seqlens=cu_seqlens,
                chunk_offsets=prepare.chunk_offsets,
                length=length,
                o=o,
                final_state=final_state,
                chunk_states=chunk_states,
                precision=prepare.precision,
                window=window,
            ):
                _with_registers(launch, registers and registers[1]).run()
    if on_cuda:
        main.wait_stream(side)
