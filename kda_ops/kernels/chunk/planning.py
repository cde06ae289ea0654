"""Launch planning for the chunked kernels, host-side and pure: the constexpr flags the
prepare kernels take, their tile widths and warps, and the pipeline stages, value columns
and launches of the head-parallel scans (the forward's recurrence, the backward's dS
scan). Pure functions of the shapes and the device's sizes (the tensors' device, or a
``target`` such as ``sizes.HOPPER`` that ``lowering/tensorrt.py`` plans for), so that
``tests/kda_ops/kernels/test_sm90_compile.py`` configures a kernel as its launcher does."""

from typing import Optional

import torch
from torch import Tensor

from kda_ops import reference
from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.sizes import DeviceSizes, cdiv, device_sizes, next_power_of_2
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions


def uses_safe_gate(lower_bound: Optional[float], has_gate: bool, dtype: torch.dtype) -> bool:
    """Whether diagonal blocks may be dense dots: the in-kernel safe gate bounds a block's
    decay by e^80, inside fp32 / bf16 range; fp16's (e^11) is too small."""
    return (
        has_gate
        and lower_bound is not None
        and lower_bound >= reference.SAFE_GATE_LOWER_BOUND
        and dtype != torch.float16
    )


def single_prepare_pass(flags: dict[str, object]) -> bool:
    """Whether the prepare kernel runs in one ``"all"`` launch that redoes no chunk: with
    the safe gate (dense diagonal blocks in range) or a scalar gate (exact dense diagonal
    blocks); else a ``"bounded"`` and an ``"unbounded"`` launch (``prepare.py``)."""
    return bool(flags["SAFE_GATE"] or flags["SCALAR_GATE"])


def prepare_flags(
    inputs: DeltaRuleInputs, cu_seqlens: Optional[Tensor], options: DeltaRuleOptions
) -> dict[str, object]:
    """The constexpr flags the forward's and the backward's token-parallel kernels share.
    fp32 inputs get exact fp32 products; fp16 / bf16 use the tensor cores."""
    q, lower_bound, has_gate = inputs.q, options.lower_bound, inputs.A_log is not None
    return dict(
        SCALAR_GATE=inputs.g.dim() == 3,
        USE_GATE=has_gate,
        HAS_DT_BIAS=inputs.dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None and has_gate,
        SAFE_GATE=uses_safe_gate(lower_bound, has_gate, q.dtype),
        USE_L2NORM=options.use_qk_l2norm,
        USE_BETA_SIGMOID=options.use_beta_sigmoid,
        IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


# Windows of the pipelined forward (``pipeline.py``) and the fewest tokens a window takes.
# Two windows at H = 96: 0.92x one pass's time, four 0.94x, eight 1.41x; the varlen case
# in four windows took 1.89x (``benchmarks/results/ab_pipelined_*.json``), in two windows of
# the packed row's token positions 1.05x (``ops_forward96_windows_h100.json``).
PIPELINE_WINDOWS = 2
MIN_WINDOW_TOKENS = 2048


# Registers a thread of the time windows' kernels, 4-warp programs of 16-bit inputs: two
# recurrence programs and one prepare program then fill an SM's 64K (2 · 200 + 112 a thread
# of 128), so that the next window's prepare also runs on the SMs that hold two of the
# recurrence's programs, which their own counts (240 and 128) filled. Capped, a recurrence
# step takes 373 instructions a warp instead of 350 (its 40 spilled bytes lie outside the
# loop) and the prepare 1312 instead of 1280 (sm_90, Triton 3.6).
WINDOW_PREPARE_REGISTERS = 112
WINDOW_RECURRENCE_REGISTERS = 200


def window_registers(block_k: int, precision: str) -> Optional[tuple[int, int]]:
    """(prepare, recurrence) registers a thread in the pipelined forward's windows, or
    ``None`` (uncapped): past 128 key columns (8-warp programs) and for fp32 inputs, whose
    kernels take other counts."""
    if block_k > 128 or precision == "ieee":
        return None
    return WINDOW_PREPARE_REGISTERS, WINDOW_RECURRENCE_REGISTERS


def pipeline_window_steps(length: int, packed: bool, device: torch.device) -> int:
    """16-token steps of a window of the pipelined forward over sequences of ``length``
    tokens, 0 for one pass: on CUDA, fixed-length sequences that hold ``PIPELINE_WINDOWS``
    windows of ``MIN_WINDOW_TOKENS``, a ``PIPELINE_WINDOWS``-th of ``length``. Packed
    sequences take one pass (they ran slower in windows); so does the interpreter (tests
    ask for windows explicitly)."""
    if device.type != "cuda" or packed or not isinstance(length, int):
        return 0
    if length < PIPELINE_WINDOWS * MIN_WINDOW_TOKENS:
        return 0
    return cdiv(cdiv(length, FORWARD_CHUNK), PIPELINE_WINDOWS)


def forward_chunk(
    batch: int,
    length: int,
    value_heads: int,
    head_v: int,
    cu_seqlens: Optional[Tensor],
    device: torch.device,
) -> int:
    """Tokens of the inference forward's prepare chunks and recurrence steps:
    ``FORWARD_CHUNK`` (16; the package docstring says why)."""
    return FORWARD_CHUNK


def dot_block(n: int) -> int:
    """The tile width of a head dim: its next power of two, at least 16 (``tl.dot`` needs
    every dim >= 16; masks cover the padding)."""
    return max(16, next_power_of_2(n))


def prepare_warps(block_k: int) -> int:
    """Warps of a prepare program (the forward's and the backward's kernel 1): 4 up to 128
    key columns, 8 past them. The program holds one 16-row block at a time, which at 4
    warps takes under 256 registers, two programs an SM (the forward's one-block chunks
    about half that, four); 8 warps, one program an SM, were slower at both chunk sizes
    (``benchmarks/results/prepare_blocks.json``, ``forward_chunk16.json``). Past 128
    columns a block's tiles need the 8 warps' registers."""
    return 4 if block_k <= 128 else 8


def scan_shared(
    stages: int,
    block_k: int,
    block_v: int,
    itemsize: int,
    aqk_itemsize: int,
    store_output: bool,
    rows: int = 64,
) -> int:
    """Bytes of shared memory a head-parallel scan's loop takes at ``stages`` stages of
    ``rows`` token rows, an upper bound (:func:`scan_stages`)."""
    tiles = itemsize * (2 * block_k + block_v)
    if store_output:
        tiles += itemsize * block_k + aqk_itemsize * rows
    return stages * (rows * tiles + 4 * block_k) + itemsize * block_k * block_v


def scan_stages(
    block_k: int,
    block_v: int,
    itemsize: int,
    aqk_itemsize: int,
    store_output: bool,
    shared_memory: int,
    rows: int = 64,
) -> int:
    """Pipeline stages of a head-parallel scan's loop over the chunks (this forward's
    ``chunk_recurrence_kernel``, the backward's dS scan): 3 at up to 64 value columns
    where their buffers fit ``shared_memory`` bytes, else 2. With 2 the next chunk's tiles
    are loaded at the end of a step, after its stores, and waited for at the start of the
    next; with 3 the loads run a whole step ahead. A stage holds w, kd ``[64, BK]`` and u
    (dO) ``[64, BV]`` in the input dtype (``itemsize`` bytes), with the outputs also qg
    ``[64, BK]`` and Aqk ``[64, 64]`` in its own dtype, and G_C; the state operand takes
    up to ``[BK, BV]`` more (:func:`scan_shared`). At K = 128 in bf16 the recurrence's
    3 stages fit Hopper's shared memory up to 64 value columns, not at 128. The segmented
    path's maps pass (no outputs) would fit 3 stages at 128 columns too, but runs slower
    with them than with 2, while at 64 columns the third stage pays there as well
    (``benchmarks/cp.py``); hence the 64-column limit for every scan. A step of ``rows``
    < 64 token rows (the forward's 16-token recurrence) has a quarter of the buffers; there
    2 stages were much slower than 3 (``benchmarks/results/forward_chunk16.json``).

    Up to 128 key columns 2 stages are taken unchecked: they fit every launch there, fp32
    inputs included, whose tiles take less than the bound. Past 128 a stage of the
    recurrence's tiles is about half of shared memory: 2 stages where they fit (narrow
    value blocks), else 1, whose loads wait at the start of each step.
    ``tests/kda_ops/kernels/test_sm90_compile.py`` checks the launches against the limit."""
    tiles = dict(
        block_k=block_k,
        block_v=block_v,
        itemsize=itemsize,
        aqk_itemsize=aqk_itemsize,
        store_output=store_output,
        rows=rows,
    )
    if block_v <= 64 and scan_shared(stages=3, **tiles) <= shared_memory:
        return 3
    if block_k <= 128 or scan_shared(stages=2, **tiles) <= shared_memory:
        return 2
    return 1


def scan_residency(shared: int, warps: int, shared_memory: int) -> int:
    """Programs of a head-parallel scan one SM holds at once: as many as its ``shared``
    bytes fit ``shared_memory``, at most as many as Hopper's 64K registers hold at 255 a
    thread (2 at 4 warps). One for the 64-row steps, two for the 16-row steps at up to 64
    value columns, which the wave split of the launches counts (:func:`scan_launches`)."""
    return max(1, min(shared_memory // shared, 65536 // (255 * 32 * warps)))


def scan_widest(block_k: int, itemsize: int) -> int:
    """The most value columns a scan program takes: its fp32 state ``[BK, columns]``
    lives in registers. 128 up to 128 key columns; past them 64 (at 256 key columns the
    state alone is 64 registers a thread at 8 warps, ``scan_warps``), and 32 with fp32
    inputs, whose products hold their operands in shared memory, which the dS scan at 64
    columns all but fills."""
    if block_k <= 128:
        return 128
    return 64 if itemsize <= 2 else 32


def scan_warps(block_k: int) -> int:
    """Warps of a forward recurrence program: 4, and 8 past 128 key columns, where a
    ``[256, 64]`` fp32 state alone takes 128 registers a thread at 4 warps and the program
    spills; 8 warps halve that."""
    return 4 if block_k <= 128 else 8


# The value-column widths a scan program may take below the whole head, narrowest first.
SCAN_COLUMN_SPLITS = (32, 64)
# ... past 128 key columns with 16-bit inputs in 64-token steps (``scan_column_splits``).
WIDE_KEY_COLUMN_SPLITS = (16, 64)


def scan_column_splits(block_k: int, itemsize: int, rows: int) -> tuple[int, ...]:
    """The value-column widths below the whole head a scan of ``rows``-token steps may
    take: ``SCAN_COLUMN_SPLITS``; past 128 key columns with 16-bit inputs in 64-token steps
    ``WIDE_KEY_COLUMN_SPLITS``, no 32: there the bf16 recurrence at 32 value columns
    returned wrong states or hit an illegal address (K = 192 and 256; which one, by the
    warps: 4 or 8) on an H100 with Triton 3.6, where 16 and 64 columns were exact
    (``tools/recurrence_probe.py``, ``benchmarks/results/recurrence_probe_h100.jsonl``)."""
    if block_k > 128 and itemsize <= 2 and rows == 64:
        return WIDE_KEY_COLUMN_SPLITS
    return SCAN_COLUMN_SPLITS


def _excluded(columns: int, splits: tuple[int, ...]) -> bool:
    """Whether ``splits`` leaves out a width the default splits take (32 past 128 key
    columns in 16 bits: :func:`scan_column_splits`)."""
    return columns in SCAN_COLUMN_SPLITS and columns not in splits


def scan_value_columns(
    block_v: int,
    sequence_heads: int,
    sm_count: Optional[int],
    three_stages_at_64: bool,
    widest: int = 128,
    splits: tuple[int, ...] = SCAN_COLUMN_SPLITS,
) -> int:
    """Value columns per program of a head-parallel scan over the chunks (this forward's
    recurrence, the backward's reverse scan) on ``sm_count`` SMs (``None`` off CUDA): the
    fewest that still leave every program an SM of its own; where none does, 64 if a scan
    at 64 columns runs 3 stages (``three_stages_at_64``, from :func:`scan_stages`), else
    128, at most ``widest`` (:func:`scan_widest`). Each program walks all chunks serially,
    so splitting V pays while SMs are idle; and a step at 64 columns with its loads a
    chunk ahead (3 stages) beats one at 128 waiting for its loads, even when the
    64-column programs take two waves. Without the third stage 64 columns lose to 128,
    hence 128 then (``benchmarks/launch_sweep.py --only recurrence``). ``splits``: the
    narrower widths allowed (:func:`scan_column_splits`); a head of exactly a width not
    among them takes the narrowest. Off CUDA (the interpreter) 32, so that CI covers
    several value blocks."""
    if sm_count is None:
        return min(block_v, 32)
    for columns in splits:
        if columns < block_v and sequence_heads * (block_v // columns) <= sm_count:
            return columns
    columns = min(block_v, 64 if three_stages_at_64 else 128, widest)
    return splits[0] if _excluded(columns, splits) else columns


def scan_config(
    block_k: int,
    block_v: int,
    sequence_heads: int,
    sm_count: Optional[int],
    itemsize: int,
    aqk_itemsize: int,
    store_output: bool,
    shared_memory: int,
    pipelined: bool = True,
    rows: int = 64,
    run_ahead: bool = True,
) -> tuple[int, int]:
    """(value columns a program, pipeline stages) of a head-parallel scan over the chunks:
    :func:`scan_value_columns` and :func:`scan_stages` for its tiles (arguments as
    there), or 1 stage where the launcher does not pipeline the loop. ``run_ahead``:
    whether, where the SMs cannot give every program its own, 64 columns at 3 stages
    beat 128 at 2 (the forward's recurrence); the dS scan's do not, its 64-column
    programs taking two waves where 128-column ones take one
    (``benchmarks/results/launch_sweep_state96.json``)."""
    widest = scan_widest(block_k, itemsize)
    splits = scan_column_splits(block_k, itemsize, rows)
    if not pipelined:
        columns = scan_value_columns(
            block_v=block_v,
            sequence_heads=sequence_heads,
            sm_count=sm_count,
            three_stages_at_64=False,
            widest=widest,
            splits=splits,
        )
        return columns, 1
    tiles = dict(
        itemsize=itemsize,
        aqk_itemsize=aqk_itemsize,
        store_output=store_output,
        shared_memory=shared_memory,
        rows=rows,
    )
    three_stages_at_64 = run_ahead and scan_stages(block_k=block_k, block_v=64, **tiles) == 3
    columns = scan_value_columns(
        block_v=block_v,
        sequence_heads=sequence_heads,
        sm_count=sm_count,
        three_stages_at_64=three_stages_at_64,
        widest=widest,
        splits=splits,
    )
    return columns, scan_stages(block_k=block_k, block_v=columns, **tiles)


def scan_launch(
    block_k: int,
    block_v: int,
    sequence_heads: int,
    device: torch.device,
    itemsize: int,
    aqk_itemsize: int,
    store_output: bool,
    pipelined: bool = True,
    rows: int = 64,
    run_ahead: bool = True,
    *,
    target: Optional[DeviceSizes] = None,
) -> tuple[int, int]:
    """:func:`scan_config` on ``device``, or on the device ``target`` describes."""
    sizes = device_sizes(device) if target is None else target
    return scan_config(
        block_k=block_k,
        block_v=block_v,
        sequence_heads=sequence_heads,
        sm_count=sizes.processors,
        itemsize=itemsize,
        aqk_itemsize=aqk_itemsize,
        store_output=store_output,
        shared_memory=sizes.shared_memory,
        pipelined=pipelined,
        rows=rows,
        run_ahead=run_ahead,
    )


def scan_launches(
    block_v: int,
    sequence_heads: int,
    columns: int,
    slots: int,
    splits: tuple[int, ...] = SCAN_COLUMN_SPLITS,
) -> list[tuple[int, int, int]]:
    """(first sequence-head, sequence-heads, value columns) of each launch of a scan that
    takes ``columns`` (``scan_value_columns``) where ``slots`` programs run at once (SMs
    × :func:`scan_residency`): one launch, unless its programs need more than one wave
    and the heads past the first wave fit one wave at half the columns; then those run in
    a second launch at half the columns, shorter steps in place of a second wave of full
    ones: the remaining heads' programs at half the columns finish sooner than a second
    wave at full width would. Half the columns only where ``splits`` allows that width
    (:func:`scan_column_splits`)."""
    per_head = cdiv(block_v, columns)
    first_wave = slots // per_head
    rest = sequence_heads - first_wave
    half = columns // 2
    allowed = half >= 16 and not _excluded(half, splits)
    if first_wave > 0 and rest > 0 and allowed and rest * cdiv(block_v, half) <= slots:
        return [(0, first_wave, columns), (first_wave, rest, half)]
    return [(0, sequence_heads, columns)]


def scan_plan(
    block_k: int,
    block_v: int,
    sequence_heads,
    device: torch.device,
    itemsize: int,
    aqk_itemsize: int,
    store_output: bool,
    warps: int,
    pipelined: bool = True,
    rows: int = 64,
    run_ahead: bool = True,
    *,
    target: Optional[DeviceSizes] = None,
) -> list[tuple]:
    """(first sequence-head, sequence-heads, value columns, pipeline stages) of each launch
    of a head-parallel scan on ``device`` (or on the device ``target`` describes: an
    ahead-of-time build's): :func:`scan_launch`'s columns, its programs
    split past one wave by :func:`scan_launches` (``warps`` a program, which with its
    buffers sets how many share an SM). With a symbolic ``sequence_heads`` (a graph traced
    for any batch) one launch at the columns of a batch that fills the SMs."""
    sizes = device_sizes(device) if target is None else target
    sms, shared = sizes.processors or 1, sizes.shared_memory  # no SMs: the interpreter's one
    tiles = dict(itemsize=itemsize, aqk_itemsize=aqk_itemsize, store_output=store_output)
    options = dict(pipelined=pipelined, rows=rows, run_ahead=run_ahead, target=sizes)

    def stages(columns: int) -> int:
        return (
            scan_stages(block_k=block_k, block_v=columns, **tiles, shared_memory=shared, rows=rows)
            if pipelined
            else 1
        )

    if not isinstance(sequence_heads, int):
        columns, column_stages = scan_launch(
            block_k=block_k, block_v=block_v, sequence_heads=sms, device=device, **tiles, **options
        )
        return [(0, sequence_heads, columns, column_stages)]
    columns, column_stages = scan_launch(
        block_k=block_k,
        block_v=block_v,
        sequence_heads=sequence_heads,
        device=device,
        **tiles,
        **options,
    )
    buffers = scan_shared(
        stages=column_stages, block_k=block_k, block_v=columns, **tiles, rows=rows
    )
    slots = sms * scan_residency(buffers, warps, shared)
    splits = scan_column_splits(block_k, itemsize, rows)
    return [
        (first, heads, split, stages(split))
        # Positional: tests stand in for scan_launches with a lambda taking *args.
        for first, heads, split in scan_launches(block_v, sequence_heads, columns, slots, splits)
    ]
