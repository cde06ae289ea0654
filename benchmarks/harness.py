"""Timing and reporting shared by the benchmarks: the peers (flash-linear-attention, and
FlashKDA where it imports) are always timed in the same process, in rounds of rotated
order; every row prints our time, the peers' and the ratio, and goes to a results file
(``results.py``)."""

import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from results import row

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # FLA's own Triton path ...
os.environ.setdefault("FLA_FLASH_KDA", "0")  # ... never its FlashKDA backend


def import_fla_chunk_kda() -> Callable | None:
    """FLA's ``chunk_kda``, or None where fla-core does not import."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception as error:  # not installed, or no GPU for its Triton set-up
        print(f"FLA not timed: fla-core does not import ({error!r})", flush=True)
        return None
    return chunk_kda


def import_flash_kda():
    """The ``flash_kda`` module (FlashKDA's package, on ``PYTHONPATH`` as its README builds
    it), or None where it or its extension does not import."""
    try:
        import flash_kda
    except Exception as error:
        print(f"FlashKDA not timed: flash_kda does not import ({error!r})", flush=True)
        return None
    return flash_kda


@dataclass
class Row:
    case: str
    ours_ms: float
    peer_ms: float | None
    bytes_moved: float = 0.0

    @property
    def ratio(self) -> float | None:
        return None if self.peer_ms is None else self.ours_ms / self.peer_ms

    def records(self) -> list[dict]:
        """The row as results rows (one measurement each: ``do_bench``'s median)."""
        extra = {"bytes_moved": self.bytes_moved} if self.bytes_moved else {}
        records = [row(self.case, "kda-ops", "time", [self.ours_ms * 1e3], "us", **extra)]
        if self.peer_ms is not None:
            records.append(row(self.case, "fla", "time", [self.peer_ms * 1e3], "us", **extra))
        return records

    def format(self) -> str:
        peer = "-" if self.peer_ms is None else f"{self.peer_ms * 1e3:9.1f}"
        ratio = "-" if self.ratio is None else f"{self.ratio:5.2f}x"
        bandwidth = f"{self.bytes_moved / self.ours_ms / 1e9:6.2f}" if self.bytes_moved else "-"
        peer_bw = "-"
        if self.bytes_moved and self.peer_ms:
            peer_bw = f"{self.bytes_moved / self.peer_ms / 1e9:6.2f}"
        return (f"| {self.case} | {self.ours_ms * 1e3:9.1f} | {peer} | {ratio} "
                f"| {bandwidth} | {peer_bw} |")  # fmt: skip


HEADER = ("| case | ours (µs) | FLA (µs) | ours / FLA | ours TB/s | FLA TB/s |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip


def time_ms(fn) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench: warm-up, L2 flush between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def cpu_time_ms(fn, repeats: int = 3) -> float:
    """Median wall milliseconds of ``fn`` over ``repeats`` calls after one: the CPU path's
    timer (a check of a script's plumbing, not of the kernels)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def capture_graph(calls) -> Callable[[], None]:
    """``calls`` (callables) captured in turn into one CUDA graph, after a run of each on a
    side stream (compile and autotune outside the capture); returns the graph's replay.
    The graph keeps the buffers the calls allocated (its private memory pool)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay


def graph_time_ms(calls) -> float:
    """Median milliseconds per call of ``calls`` (callables) replayed in turn from one CUDA
    graph: device time without the host's dispatch, which dominates eager timing of ops
    that take tens of µs. Give calls on enough distinct buffers that one pass moves more
    than the L2 cache (50 MB on an H200), or the rate measured is L2's."""
    from triton.testing import do_bench

    replay = capture_graph(calls)
    return do_bench(replay, warmup=10, rep=100, return_mode="median") / len(calls)


def rotated_rounds(calls: dict[str, Callable], rounds: int, timer: Callable = time_ms,
                   errors: dict[str, str] | None = None,
                   deadline: float | None = None) -> dict[str, list[float]]:  # fmt: skip
    """Times each of ``calls`` (name -> callable) once a round with ``timer``, the order
    rotated by one each round, so that no library always runs first (or right after the
    same other one). Returns name -> one time a round. A call that raises is dropped from
    later rounds and its error kept in ``errors`` (name -> repr). No round starts once
    ``time.monotonic()`` has passed ``deadline`` (the first always runs), so a time budget
    ends a case with fewer rounds, every call timed in each."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        if round_ and deadline is not None and time.monotonic() > deadline:
            break
        shift = round_ % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            if errors is not None and name in errors:
                continue
            try:
                times[name].append(timer(calls[name]))
            except Exception as error:
                if errors is None:
                    raise
                errors[name] = repr(error)
    return {name: values for name, values in times.items() if values}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """FLA's metric: ||expected - got|| / ||expected||, in float64."""
    expected = expected.double()
    return ((got.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def copy_bandwidth_tbs(nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling for our kernels."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return nbytes / time_ms(lambda: dst.copy_(src)) / 1e9


def report(title: str, benches: dict, results=None) -> list[Row]:
    """Runs each benchmark (name -> a callable returning rows) and prints its rows as they
    come, adding them to ``results`` (a ``results.Results``); a failing one prints its name
    and error and the others still run."""
    print(f"\n### {title}\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(HEADER, flush=True)
    rows = []
    for name, bench in benches.items():
        try:
            bench_rows = bench()
        except Exception as error:  # one failing case should not cost a run's other rows
            print(f"| {name} failed: {error!r} | | | | | |", flush=True)
            continue
        for bench_row in bench_rows:
            print(bench_row.format(), flush=True)
            rows.append(bench_row)
            if results is not None:
                results.add(bench_row.records())
    return rows


WARMUP_STEPS = 3


def kernel_times_us(step: Callable[[], object], steps: int) -> Counter:
    """Device µs a step of each kernel ``step()`` launches (by kernel name; torch.profiler
    over ``steps`` steps after ``WARMUP_STEPS`` that compile and autotune)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = Counter()
    for event in prof.key_averages():
        if event.device_type == DeviceType.CUDA:
            times[event.key] += event.self_device_time_total / steps
    return times
