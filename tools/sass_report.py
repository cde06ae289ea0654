"""What a kernel compiles to for sm_90, on a machine without a GPU: registers, shared
memory, spills (the thread's stack frame, where ptxas puts the registers it spills, and
the local-memory loads and stores that move them), the SASS instruction mix, and, by
source line, the shared-memory bytes a thread moves and the barriers it waits at (where
Triton converts a tile between layouts, or stages a dot operand, it goes through shared
memory).

Kernels as their launchers configure them: the variants of
``tests/kda_ops/kernels/test_sm90_compile.py``, by name (``--list``). The counts are
static: an instruction inside a loop counts once, as one step of it; what a launch moves
in all is this times its steps and programs. They are a compiler's view, not a timing:
a layout change that moves fewer bytes is worth timing on the GPU
(``benchmarks/ab.py``), not taken as faster. The Triton that compiles is the one
importable here; put the GPU machine's version first on ``PYTHONPATH`` to see its code.

Usage, from the repository root::

    python tools/sass_report.py chunk_prepare_kernel/all [--lines 12] [--json report.json]
        [--tree DIR]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_OPS = ("LDS", "STS", "LDSM", "STSM")
# SASS line: /*0a30*/ [@P0] OPCODE.MODIFIERS operands ;
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]+)?")
SOURCE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def variants(tree: str | None = None) -> dict[str, tuple]:
    """The sm_90 compile test's kernels as launched, by name; with ``tree``, the
    ``kda_ops`` of that directory's (a checkout, or ``git archive REF kda_ops tests``
    unpacked), and its compile table too where it has one (a change of a kernel's
    arguments comes with its table)."""
    sys.path.insert(0, str(REPO))
    if tree is not None:
        sys.path.insert(0, str(Path(tree).resolve()))
    from tests.kda_ops.kernels.test_sm90_compile import ARG_TYPES, VARIANTS

    return {name: (*spec, ARG_TYPES) for name, spec in VARIANTS.items()}


def compile_cubin(module: str, kernel_name: str, constexprs: dict, *extra) -> tuple[bytes, int]:
    """(cubin, shared bytes) of a variant compiled for sm_90 (arguments as the compile
    test's table gives them: argument types and launch options, then the default types;
    pointers unnamed there are bf16). Call it in a process without ``TRITON_INTERPRET``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    *specific, default_types = extra
    kernel = getattr(importlib.import_module(f"kda_ops.kernels.{module}"), kernel_name)
    # A constexpr left out would compile as a pointer argument, a variant never launched.
    missing = [kernel.arg_names[i] for i in kernel.constexprs
               if kernel.arg_names[i] not in constexprs]  # fmt: skip
    if missing:
        raise ValueError(f"{kernel_name}: constexprs not given: {missing}")
    types = {**default_types, **(specific[0] if specific else {})}
    options = {"num_warps": 4, **(specific[1] if len(specific) > 1 else {})}
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = types.get(arg, "*bf16")
        if signature[arg].startswith("*"):  # aligned like every tensor a launcher passes
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, attrs=attrs, constexprs={
        (kernel.arg_names.index(name),): value for name, value in constexprs.items()})  # fmt: skip
    binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return binary.asm["cubin"], binary.metadata.shared


def _tool(name: str) -> str:
    """A CUDA binary tool from Triton's NVIDIA backend (``nvdisasm``, ``cuobjdump``)."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def shared_bytes(opcode: str, modifiers: str) -> int:
    """Bytes a thread moves in one shared-memory instruction: ``ldmatrix`` / ``stmatrix``
    move 4 bytes a thread per 8×8 matrix (``.x2``, ``.x4``: 2, 4 of them); ``LDS`` / ``STS``
    their access width (``.64``, ``.128``; 32 bits by default)."""
    if opcode in ("LDSM", "STSM"):
        return 4 * (4 if modifiers.endswith(".4") else 2 if modifiers.endswith(".2") else 1)
    return 16 if ".128" in modifiers else 8 if ".64" in modifiers else 4


def resource_usage(text: str) -> dict[str, int]:
    """Registers and stack bytes a thread (``reg``, ``stack``) from ``cuobjdump
    -res-usage``'s line. Spilled registers go to the stack frame: cuobjdump's ``LOCAL``
    stays 0 for them."""
    return {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK):(\d+)", text)}


def report(cubin: bytes, shared: int) -> dict:
    """The static counts of a compiled kernel (module docstring)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(cubin)
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], check=True,
                               capture_output=True, text=True).stdout  # fmt: skip
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-g", path], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
    resources = resource_usage(usage)
    opcodes = collections.Counter()
    by_line = collections.defaultdict(lambda: {"shared_bytes": 0, "barriers": 0})
    where = "?"
    for text in sass.splitlines():
        source = SOURCE_LINE.search(text)
        if source:
            where = f"{Path(source.group(1)).name}:{source.group(2)}"
            continue
        match = INSTRUCTION.match(text)
        if not match:
            continue
        opcode, modifiers = match.group(1), match.group(2) or ""
        opcodes[opcode] += 1
        if opcode in SHARED_OPS:
            by_line[where]["shared_bytes"] += shared_bytes(opcode, modifiers)
        elif opcode == "BAR":
            by_line[where]["barriers"] += 1
    lines = dict(sorted(by_line.items(), key=lambda item: -item[1]["shared_bytes"]))
    return {
        "registers": resources.get("reg"),
        "stack_bytes": resources.get("stack"),
        "spill_instructions": opcodes["LDL"] + opcodes["STL"],
        "shared_memory": shared,
        "instructions": sum(opcodes.values()),
        "shared_bytes_a_thread": sum(line["shared_bytes"] for line in lines.values()),
        "barriers": opcodes["BAR"],
        "opcodes": dict(opcodes.most_common()),
        "by_line": lines,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", help="names from --list")
    parser.add_argument("--list", action="store_true", help="the variants there are")
    parser.add_argument("--lines", type=int, default=12, help="source lines to print")
    parser.add_argument("--json", help="write the reports to this file")
    parser.add_argument("--tree", help="a directory whose kda_ops to compile (default: this)")
    args = parser.parse_args()
    if "TRITON_INTERPRET" in os.environ:
        parser.error("unset TRITON_INTERPRET: interpreted kernels do not compile")
    table = variants(args.tree)
    if args.list:
        print("\n".join(sorted(table)))
        return
    unknown = [name for name in args.variants if name not in table]
    if unknown or not args.variants:
        parser.error(f"give variants from --list (unknown: {unknown})")
    reports = {}
    for name in args.variants:
        reports[name] = found = report(*compile_cubin(*table[name]))
        print(f"{name}: {found['registers']} registers, {found['stack_bytes']} stack bytes "
              f"({found['spill_instructions']} spill loads and stores), "
              f"{found['shared_memory']} shared bytes, {found['instructions']} instructions, "
              f"{found['barriers']} barriers, {found['shared_bytes_a_thread']} shared-memory "
              f"bytes a thread")  # fmt: skip
        for where, counts in list(found["by_line"].items())[: args.lines]:
            print(f"    {where:28} {counts['shared_bytes']:6} B  {counts['barriers']:3} barriers")
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
