"""Timing and reporting shared by the benchmarks: the peer (flash-linear-attention) is
always timed in the same process, and every row prints our time, the peer's and the ratio."""

import json
import os
from dataclasses import asdict, dataclass

import torch
from triton.testing import do_bench

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # FLA's own Triton path


@dataclass
class Row:
    case: str
    ours_ms: float
    peer_ms: float | None
    bytes_moved: float = 0.0

    @property
    def ratio(self) -> float | None:
        return None if self.peer_ms is None else self.ours_ms / self.peer_ms

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
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_time_ms(calls) -> float:
    """Median milliseconds per call of ``calls`` (callables) replayed in turn from one CUDA
    graph: device time without the host's dispatch, which dominates eager timing of ops
    that take tens of µs. Give calls on enough distinct buffers that one pass moves more
    than the L2 cache (50 MB on an H200), or the rate measured is L2's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and autotune outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / len(calls)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """FLA's metric: ||expected - got|| / ||expected||, in float64."""
    expected = expected.double()
    return ((got.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def copy_bandwidth_tbs(nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling for our kernels."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return nbytes / time_ms(lambda: dst.copy_(src)) / 1e9


def report(title: str, benches: dict, path: str | None = None) -> list[Row]:
    """Runs each benchmark (name -> a callable returning rows) and prints its rows as they
    come; a failing one prints its name and error and the others still run."""
    print(f"\n### {title}\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(HEADER, flush=True)
    rows = []
    for name, bench in benches.items():
        try:
            bench_rows = bench()
        except Exception as error:  # one failing case should not cost a run's other rows
            print(f"| {name} failed: {error!r} | | | | | |", flush=True)
            continue
        for row in bench_rows:
            print(row.format(), flush=True)
            rows.append(row)
    if path:
        with open(path, "w") as f:
            json.dump([asdict(row) | {"ratio": row.ratio} for row in rows], f, indent=1)
    return rows
