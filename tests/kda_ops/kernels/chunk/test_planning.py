"""The forward's launch planning (``planning.py``)."""

import pytest
import torch

from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.chunk.planning import (
    WINDOW_PREPARE_REGISTERS,
    WINDOW_RECURRENCE_REGISTERS,
    prepare_warps,
    scan_column_splits,
    scan_config,
    scan_launches,
    scan_plan,
    scan_residency,
    scan_shared,
    scan_stages,
    scan_warps,
    window_registers,
)
from kda_ops.kernels.sizes import HOPPER, SM90_SHARED_MEMORY, DeviceSizes, device_sizes

SMS = 132  # an H200's


@pytest.mark.parametrize(
    "block_v, heads, columns, sm_count, launches",
    [
        (128, 96, 64, 132, [(0, 66, 64), (66, 30, 32)]),  # the rest fits one wave at 32
        (128, 64, 64, 132, [(0, 64, 64)]),  # one wave
        (128, 128, 64, 132, [(0, 128, 64)]),  # 62 heads past the wave: 248 programs at 32
        (256, 128, 64, 132, [(0, 128, 64)]),  # the maps pass: V + K columns
        (128, 200, 128, 132, [(0, 200, 128)]),  # 68 past the wave: 136 programs at 64
        (32, 5, 16, 4, [(0, 5, 16)]),  # no dot narrower than 16
    ],
)
def test_scan_launches(block_v, heads, columns, sm_count, launches):
    assert scan_launches(block_v, heads, columns, sm_count) == launches


@pytest.mark.parametrize(
    "block_k, block_v, heads, itemsize, store_output, pipelined, expected",
    [
        (128, 128, 64, 2, True, True, (64, 3)),  # one wave at 64 columns
        (128, 128, 96, 2, True, True, (64, 3)),
        (128, 128, 16, 2, True, True, (32, 3)),  # idle SMs: the narrowest blocks
        (128, 128, 96, 4, True, True, (128, 2)),  # fp32: no third stage at 64
        (128, 128, 96, 4, True, False, (128, 1)),  # the backward's fp32 dS scan
        (64, 64, 96, 2, True, True, (64, 3)),
        (128, 256, 96, 2, False, True, (64, 3)),  # the maps pass (V + K columns)
        (16, 16, 4, 2, True, True, (16, 3)),
        (256, 256, 96, 2, True, True, (64, 1)),  # past 128 key columns
        (256, 256, 16, 2, True, True, (64, 1)),  # 16-bit past 128: never 32 (next test)
        (256, 128, 8, 2, True, True, (16, 2)),
        (256, 32, 2, 2, True, True, (16, 2)),
        (256, 16, 96, 2, True, True, (16, 2)),
        (256, 256, 96, 4, True, True, (32, 1)),
        (256, 512, 96, 2, False, True, (64, 2)),
    ],
)
def test_scan_config(block_k, block_v, heads, itemsize, store_output, pipelined, expected):
    """Up to 128 columns the scans launch as tuned on the H200; past them within its
    shared memory and registers."""
    got = scan_config(block_k, block_v, heads, SMS, itemsize, itemsize, store_output,
                      SM90_SHARED_MEMORY, pipelined)  # fmt: skip
    assert got == expected


@pytest.mark.parametrize("heads", [1, 2, 8, 16, 33, 64, 96, 132, 200, 4096])
@pytest.mark.parametrize("block_v", [16, 32, 64, 128, 256])
def test_wide_keys_in_16_bits_never_take_32_value_columns_in_64_token_steps(block_v, heads):
    """Past 128 key columns the bf16 64-token scan at 32 value columns was wrong on an H100
    (``scan_column_splits``): no launch of it, the second wave's included, takes 32; the
    16-token steps and fp32 still may."""
    for store_output, run_ahead in ((True, True), (True, False), (False, True)):
        columns, stages = scan_config(256, block_v, heads, SMS, 2, 2, store_output,
                                      SM90_SHARED_MEMORY, run_ahead=run_ahead)  # fmt: skip
        assert columns != 32 and columns <= block_v
        shared = scan_shared(stages, 256, columns, 2, 2, store_output)
        slots = SMS * scan_residency(shared, 8, SM90_SHARED_MEMORY)
        splits = scan_column_splits(256, 2, 64)
        assert all(c != 32 for _, _, c in scan_launches(block_v, heads, columns, slots, splits))
    assert 32 in scan_column_splits(256, 2, FORWARD_CHUNK) + scan_column_splits(256, 4, 64)


@pytest.mark.parametrize(
    "block_k, block_v, heads, itemsize, expected",
    [
        (128, 128, 96, 2, (64, 3)),
        (128, 128, 64, 2, (64, 3)),
        (128, 128, 96, 4, (64, 3)),  # fp32: a 16-row stage fits three times at 64 columns
        (256, 256, 96, 2, (64, 3)),
    ],
)
def test_scan_config_of_the_forward_steps(block_k, block_v, heads, itemsize, expected):
    """The forward's 16-token steps take a quarter of the 64-row stages' buffers."""
    got = scan_config(block_k, block_v, heads, SMS, itemsize, itemsize, True,
                      SM90_SHARED_MEMORY, rows=FORWARD_CHUNK)  # fmt: skip
    assert got == expected


@pytest.mark.parametrize(
    "heads, expected",
    [
        (16, (32, 3)),  # idle SMs: the narrowest blocks, as the recurrence's
        (64, (64, 3)),  # one wave at 64 columns
        (96, (128, 2)),  # 64 columns would take two waves: 128, one a head
        (576, (128, 2)),  # packed sequences' sequence-heads
    ],
)
def test_scan_config_of_the_ds_scan(heads, expected):
    """The dS scan (``run_ahead=False``) takes 128 columns where 64 would not give every
    program an SM of its own."""
    got = scan_config(128, 128, heads, SMS, 2, 2, True, SM90_SHARED_MEMORY, run_ahead=False)
    assert got == expected


def _slots(rows: int, columns: int = 64, warps: int = 4) -> int:
    stages = scan_stages(128, columns, 2, 2, True, SM90_SHARED_MEMORY, rows)
    shared = scan_shared(stages, 128, columns, 2, 2, True, rows)
    return SMS * scan_residency(shared, warps, SM90_SHARED_MEMORY)


def test_two_forward_steps_programs_share_an_sm():
    """Two 16-token programs of 64 columns fit an SM (a quarter of the 64-row buffers, and
    4 warps' registers), so H = 96's 192 programs run in one launch; the 64-token steps
    hold an SM each and split the heads past the first wave."""
    assert _slots(FORWARD_CHUNK) == 2 * SMS
    assert _slots(64) == SMS
    assert scan_launches(128, 96, 64, _slots(FORWARD_CHUNK)) == [(0, 96, 64)]
    assert scan_launches(128, 96, 64, _slots(64)) == [(0, 66, 64), (66, 30, 32)]
    assert _slots(FORWARD_CHUNK, warps=8) == SMS  # 8 warps' registers: one program


def test_window_registers_fill_an_sm():
    """In the windows two 4-warp recurrence programs and one 4-warp prepare program take
    an SM's 64K registers (Hopper allocates them 8 a thread at a time), for 16-bit inputs
    up to 128 key columns; past those, and for fp32 inputs, the launches keep their own
    counts."""
    assert prepare_warps(128) == scan_warps(128) == 4
    threads = 4 * 32
    assert WINDOW_PREPARE_REGISTERS % 8 == WINDOW_RECURRENCE_REGISTERS % 8 == 0
    assert (2 * WINDOW_RECURRENCE_REGISTERS + WINDOW_PREPARE_REGISTERS) * threads == 65536
    assert window_registers(128, "tf32") == (WINDOW_PREPARE_REGISTERS, WINDOW_RECURRENCE_REGISTERS)
    assert window_registers(256, "tf32") is None
    assert window_registers(128, "ieee") is None


def test_scan_plan_plans_for_a_named_target_device():
    """``target`` replaces the tensors' device: off CUDA (the interpreter) 32 columns, on
    :data:`HOPPER` (the H200's SMs and shared memory) the H200's launches, as
    ``scan_config`` and ``scan_launches`` give them there."""
    cpu = torch.device("cpu")
    assert DeviceSizes(processors=SMS, shared_memory=SM90_SHARED_MEMORY) == HOPPER
    assert device_sizes(cpu) == DeviceSizes(processors=None, shared_memory=0)
    # no shared memory to count on: two stages, taken unchecked up to 128 key columns
    assert scan_plan(128, 128, 96, cpu, 2, 2, True, 4) == [(0, 96, 32, 2)]
    for rows, launches in ((FORWARD_CHUNK, [(0, 96, 64)]), (64, [(0, 66, 64), (66, 30, 32)])):
        planned = scan_plan(128, 128, 96, cpu, 2, 2, True, 4, rows=rows, target=HOPPER)
        stages = {columns: scan_stages(128, columns, 2, 2, True, SM90_SHARED_MEMORY, rows)
                  for columns in (32, 64)}  # fmt: skip
        assert planned == [(*launch, stages[launch[2]]) for launch in launches]
