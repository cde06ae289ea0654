"""Draws ``chunk_forward.py``'s rows: time against T, log-log, one line per library (the
median over rounds, the min-max spread as a band), titled with the GPU, date and versions.

Usage: ``python benchmarks/plot.py [benchmarks/results/chunk_forward.json] [--out
benchmarks/results/chunk_forward.png] [--timing eager|"CUDA graph"]``. Needs matplotlib
(``pip install -e .[bench]``); runs anywhere, no GPU.
"""

import argparse
from collections import defaultdict
from pathlib import Path

from results import RESULTS_DIR, load

LABELS = {"kda-ops": "kda-ops", "fla": "FLA (fla-core)", "flash_kda": "FlashKDA"}


def import_pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(
            "benchmarks/plot.py needs matplotlib: pip install 'kda-ops[bench]' (or "
            f"pip install matplotlib) ({error})"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def series(rows: list[dict], timing: str) -> dict[str, list[tuple[int, float, float, float]]]:
    """library -> [(T, median, min, max)] of the timed rows of ``timing``, sorted by T."""
    lines = defaultdict(list)
    for row in rows:
        if row.get("timing") != timing or "median" not in row or "T" not in row:
            continue
        lines[row["library"]].append((row["T"], row["median"], row["min"], row["max"]))
    return {library: sorted(points) for library, points in lines.items()}


def title(environment: dict, timing: str) -> str:
    versions = environment.get("versions", {})
    gpu = (environment.get("gpu") or {}).get("name", "CPU")
    shared = {True: ", shared machine", False: ", machine to itself"}.get(
        environment.get("shared_machine"), ""
    )
    date = str(environment.get("date", ""))[:10]
    settings = environment.get("settings", {}).get("sweep", {})
    shape = ", ".join(f"{key} = {settings[key]}" for key in ("B", "H", "D") if key in settings)
    flash = versions.get("flash_kda") or {}
    peers = [f"torch {versions.get('torch')}", f"triton {versions.get('triton')}"]
    if versions.get("fla-core"):
        peers.append(f"fla-core {versions['fla-core']}")
    if flash:
        peers.append(f"FlashKDA {flash.get('version')}")
    return (f"chunk forward ({timing}), {shape}, bf16, safe gate\n"
            f"{gpu}{shared}, {date}\n{', '.join(peers)}")  # fmt: skip


def plot(data: dict, out: Path, timing: str) -> None:
    plt = import_pyplot()
    lines = series(data["rows"], timing)
    if not lines:
        raise SystemExit(f"no {timing!r} timings with a T in the rows")
    figure, axes = plt.subplots(figsize=(7, 5))
    for library, points in lines.items():
        lengths, median, low, high = zip(*points)
        ms = [us / 1e3 for us in median]
        axes.plot(lengths, ms, marker="o", label=LABELS.get(library, library))
        axes.fill_between(lengths, [us / 1e3 for us in low], [us / 1e3 for us in high],
                          alpha=0.2)  # fmt: skip
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted({t for points in lines.values() for t, *_ in points}))
    axes.xaxis.set_major_formatter(lambda t, _: f"{t / 1024:g}K" if t >= 1024 else f"{t:g}")
    axes.set_yscale("log")
    axes.set_xlabel("T (tokens)")
    axes.set_ylabel("ms a call (median over rounds; band: min–max)")
    axes.set_title(title(data.get("environment", {}), timing), fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=150)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default=str(RESULTS_DIR / "chunk_forward.json"),
                        help="a chunk_forward.py results file (default: %(default)s)")  # fmt: skip
    parser.add_argument("--out", help="the PNG (default: the results file's name, .png)")
    parser.add_argument("--timing", default="eager", choices=["eager", "CUDA graph"])
    args = parser.parse_args()
    source = Path(args.results)
    out = Path(args.out) if args.out else source.with_suffix(".png")
    plot(load(source), out, args.timing)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
