"""transformers hybrid models, a row per model family: the unchanged model with FLA installed
(eager), the same under stock ``torch.compile``, and with ``kda_ops.integrations.enable()``
under ``torch.compile(backend="kda", fullgraph=True)`` (as docs/integrations.md and
docs/compile.md recommend), in one process, in rounds of rotated order. Measures prefill
tokens/s (B = 1 at T = 8192, B = 64 at T = 512) and the decode step's time (B = 1 and 64,
32 steps after a 512-token prompt; a round's value is the median step), bf16.

Every family is built from its config with random weights at hidden 2048: four layers
(three linear attention, one full attention), vocabulary 32768 (so the LM head does not
dominate the decode step), dense MLPs where the family has a choice (Qwen3.5-MoE keeps 64
experts, 8 a token), the family's own head counts and widths otherwise (``FAMILIES``).
Needs a CUDA GPU, ``transformers==5.24.0`` and ``fla-core`` (importable before the model
files are, so that transformers binds FLA's kernels; the FLA rows name what it bound).

    python benchmarks/transformers_models.py [--quick] [--model qwen3_next kimi_linear ...]
        [--paths fla torch.compile kda-ops] [--rounds 3] [--budget-s 540] [--mode MODE]
        [--shared-machine | --no-shared-machine] [--out benchmarks/results/transformers_models.json]
    python benchmarks/transformers_models.py --tiny --device cpu --backend aot_eager  # plumbing

``--budget-s S``: no family, case or round starts after 0.9 S, and at S the run stops
wherever it is (a case not finished is lost); the results file holds every finished case,
as it is rewritten after each, and (``environment.stopped``) what stopped the run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib
import inspect
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from harness import rotated_rounds  # benchmarks/, the script's folder
from results import Results, add_arguments, row

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # FLA's Triton path

REQUIRED_TRANSFORMERS = "5.24.0"
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
VOCAB = 32768


@dataclasses.dataclass(frozen=True)
class Family:
    """A transformers model family: its classes (names in ``transformers``) and the config
    entries that set its attention widths (hidden size, layers and MLP width come apart)."""

    config: str
    model: str
    sizes: dict
    vision: bool = False  # a vision-language model: ``config`` takes text_config


FAMILIES = {
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=0,
    )),
    "qwen3_5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    )),
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    )),
    "olmo_hybrid": Family("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        num_attention_heads=16, num_key_value_heads=16, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=96, linear_value_head_dim=192,
    )),
    "kimi_linear": Family("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, linear_head_dim=128,
        linear_num_heads=32, mlp_layer_types=["dense"] * 4,
    )),
    # GLM5-next ships as a vision-language model only; text input runs its text model (KDA
    # with the safe gate, MLA with the sparse-attention indexer, hyper-connections).
    "glm5_next": Family("Glm5NextConfig", "Glm5NextForConditionalGeneration", dict(
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256, index_topk=2048,
        index_kpool=16, index_head_dim=128, index_n_heads=32, linear_head_dim=128,
        linear_num_heads=32, hc_mult=4, mlp_layer_types=["dense"] * 4,
    ), vision=True),
}  # fmt: skip

PATHS = {
    "fla": "transformers + FLA, eager",
    "torch.compile": "transformers + FLA, torch.compile (stock Inductor)",
    "kda-ops": "transformers + kda_ops.integrations.enable(), "
    "torch.compile(backend='kda', fullgraph=True)",
    # The kda ops without the passes: what backend="kda" adds over stock Inductor.
    "kda-ops+inductor": "transformers + kda_ops.integrations.enable(), "
    "torch.compile(fullgraph=True) (stock Inductor)",
}
NEEDS_FLA = ("fla", "torch.compile")
DEFAULT_PATHS = ("fla", "torch.compile", "kda-ops")


class BudgetSpent(BaseException):
    """``--budget-s`` ran out: raised from the alarm wherever the run is (a BaseException,
    so that no ``except Exception`` on the way swallows it)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    device: str
    dtype: torch.dtype
    hidden: int | None  # None: the test suite's tiny configs
    prefill_len: int  # T of the B = 1 prefill
    prompt_len: int  # T of the prefill at B > 1 and of the decode prompt
    batches: tuple[int, ...]
    steps: int  # decode steps a round
    repeats: int  # timed prefill calls a round
    rounds: int
    paths: tuple[str, ...]
    mode: str | None
    backend: str | None  # replaces both compiled paths' backends (a plumbing check)
    deadline: float | None  # time.monotonic() after which no family, case or round starts


def settings(args: argparse.Namespace) -> Settings:
    if args.tiny:
        hidden, prefill_len, prompt_len, steps, repeats, rounds = None, 32, 8, 2, 1, 1
    elif args.quick:
        hidden, prefill_len, prompt_len, steps, repeats, rounds = 1024, 1024, 128, 8, 3, 2
    else:
        hidden, prefill_len, prompt_len, steps, repeats, rounds = 2048, 8192, 512, 32, 5, 3
    paths = tuple(dict.fromkeys(args.paths))
    if args.device == "cpu" and any(path in NEEDS_FLA for path in paths):
        dropped = [path for path in paths if path in NEEDS_FLA]
        print(f"--device cpu: FLA's Triton kernels need a GPU; not timed: {' '.join(dropped)}")
        paths = tuple(path for path in paths if path not in NEEDS_FLA)
    if not paths:
        raise SystemExit("transformers_models.py: no path left to time (--paths)")
    deadline = None
    if args.budget_s is not None:
        deadline = time.monotonic() + 0.9 * args.budget_s
    return Settings(
        device=args.device, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
        hidden=hidden, prefill_len=args.prefill_len or prefill_len,
        prompt_len=args.prompt_len or prompt_len, batches=tuple(args.batches),
        steps=args.steps or steps, repeats=repeats, rounds=args.rounds or rounds, paths=paths,
        mode=args.mode, backend=args.backend, deadline=deadline,
    )  # fmt: skip


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def check_environment(names: list[str], s: Settings) -> None:
    """Exit with one message naming everything missing: transformers at the version the
    families are written for, a CUDA GPU, FLA (imported here, before the model files, so
    that transformers binds its kernels), the families themselves, the ``kda`` backend."""
    problems = []
    try:
        import transformers
    except ImportError as error:
        sys.exit(f"transformers_models.py needs transformers=={REQUIRED_TRANSFORMERS} ({error})")
    if transformers.__version__ != REQUIRED_TRANSFORMERS:
        problems.append(
            f"transformers=={REQUIRED_TRANSFORMERS} (found {transformers.__version__}; "
            f"`pip install --no-deps transformers=={REQUIRED_TRANSFORMERS}`)"
        )
    if s.device == "cuda" and not torch.cuda.is_available():
        problems.append("a CUDA GPU (or --device cpu, a check of the plumbing)")
    if any(path in NEEDS_FLA for path in s.paths):
        try:
            import fla.ops.gated_delta_rule
            import fla.ops.kda  # noqa: F401
        except Exception as error:  # not installed, or its set-up fails here
            problems.append(
                f"fla-core for the {'/'.join(p for p in s.paths if p in NEEDS_FLA)} rows "
                f"(`pip install --no-deps fla-core==0.6.0 einops`; {error}), "
                "or --paths without them"
            )
    for name in names:
        family = FAMILIES[name]
        try:  # the model classes' look-up imports the model files
            importlib.import_module(f"transformers.models.{name}")
            for class_name in (family.config, family.model):
                getattr(transformers, class_name)
        except (ImportError, AttributeError) as error:
            problems.append(
                f"model family {name!r}, which transformers {transformers.__version__} "
                f"does not provide ({type(error).__name__}: {error})"
            )
    try:
        import lowering.inductor  # noqa: F401
    except ImportError as error:
        problems.append(f"lowering.inductor, the kda backend ({error})")
    if problems:
        sys.exit("transformers_models.py needs " + "; ".join(problems))


def build(name: str, s: Settings) -> torch.nn.Module:
    """The family's model, random weights, on ``s.device`` in ``s.dtype``, eval mode."""
    if s.hidden is None:
        from tests.kda_ops.integrations.models import BUILDERS

        return BUILDERS[name]().to(s.device, s.dtype)
    import transformers

    family = FAMILIES[name]
    # Special token ids inside VOCAB (some families' defaults are past it).
    entries = dict(vocab_size=VOCAB, hidden_size=s.hidden, intermediate_size=2 * s.hidden,
                   num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    entries |= family.sizes
    config_class = getattr(transformers, family.config)
    if family.vision:  # a one-block vision tower: text input never runs it
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                      out_hidden_size=s.hidden)  # fmt: skip
        config = config_class(text_config=entries, vision_config=vision)
    else:
        config = config_class(**entries)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(s.device):  # built in place: a CPU init of these weights takes long
        model = getattr(transformers, family.model)(config)
    return model.to(s.dtype).eval()


def kernel_bindings(model: torch.nn.Module) -> dict[str, str]:
    """What transformers bound each kernel wrapper of the model's file to: FLA's function
    (``fla....``), or its own PyTorch fallback where the package did not import. Read while
    kda_ops' swaps are off."""
    module = sys.modules[type(model).__module__]
    bindings = {}
    for attribute, fn in vars(module).items():
        if not (inspect.isfunction(fn) and hasattr(fn, "__wrapped__")):
            continue
        if fn.__module__ != module.__name__:
            continue
        bound = inspect.getclosurevars(fn).nonlocals.get("implementation")
        if bound is None:
            bindings[attribute] = "unknown"
        elif bound is fn.__wrapped__:
            bindings[attribute] = "transformers (PyTorch fallback)"
        else:
            bindings[attribute] = f"{bound.__module__}.{bound.__qualname__}"
    return bindings


@contextlib.contextmanager
def integration(path: str, name: str) -> Iterator[None]:
    """kda_ops' swaps on for the kda-ops paths, off for the others. Toggling costs no
    recompile: dynamo keeps each state's graphs (its guards tell them apart)."""
    if not path.startswith("kda-ops"):
        yield
        return
    import kda_ops.integrations as integrations

    integrations.enable()
    try:
        if name not in integrations.enabled():
            raise RuntimeError(
                f"kda_ops.integrations.enable() left {name} alone: "
                f"{integrations.unrecognised() or 'no delta rule found in its files'}"
            )
        yield
    finally:
        integrations.disable()


def compiled(model: torch.nn.Module, s: Settings) -> dict[str, Callable]:
    """Each path's callable: the model itself, or a compiled wrapper of it."""
    from lowering.inductor import kda_backend  # backend="kda" without the entry point

    mode = {} if s.mode is None else {"mode": s.mode}
    makers = {
        "fla": lambda: model,
        "torch.compile": lambda: torch.compile(model, backend=s.backend or "inductor", **mode),
        "kda-ops": lambda: torch.compile(model, backend=s.backend or kda_backend,
                                         fullgraph=True, **mode),
        "kda-ops+inductor": lambda: torch.compile(model, backend=s.backend or "inductor",
                                                  fullgraph=True, **mode),
    }  # fmt: skip
    return {path: makers[path]() for path in s.paths}


def describe(path: str, s: Settings) -> str:
    """The path as the rows name it, with ``--backend`` where it replaced the backend."""
    if s.backend is None or path == "fla":
        return PATHS[path]
    return f"{PATHS[path]}, its backend replaced by {s.backend!r} (--backend)"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_seconds(fn: Callable[[], object], device: str) -> float:
    """Wall time of one call, from an idle device to its last kernel's end."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


@dataclasses.dataclass
class Case:
    """One case of a family: how to warm a path up and how to time one round of it."""

    name: str
    metric: str
    units: str
    warm_up: Callable[[Callable], None]
    one_round: Callable[[Callable], float]
    faster_is_higher: bool


def _vocab(model: torch.nn.Module) -> int:
    return model.config.get_text_config().vocab_size


def prefill_case(name: str, model: torch.nn.Module, batch: int, length: int, s: Settings) -> Case:
    ids = torch.randint(3, _vocab(model), (batch, length), device=s.device)

    def call(fn: Callable) -> None:
        fn(ids, logits_to_keep=1)

    def one_round(fn: Callable) -> float:
        call(fn)  # untimed: the other paths ran last
        times = [wall_seconds(lambda: call(fn), s.device) for _ in range(s.repeats)]
        return ids.numel() / statistics.median(times)

    return Case(f"{name} prefill B={batch} T={length}", "throughput", "tokens/s",
                warm_up=lambda fn: [call(fn) for _ in range(2)], one_round=one_round,
                faster_is_higher=True)  # fmt: skip


def decode_case(name: str, model: torch.nn.Module, batch: int, s: Settings) -> Case:
    """Decode steps from one prompt's cache (an eager prefill under the first path's
    integration: FLA's kernels, or kda_ops' where FLA is not timed); every round starts
    from a copy of it, so the KV cache grows from ``prompt_len`` in each."""
    from transformers import DynamicCache

    prompt = torch.randint(3, _vocab(model), (batch, s.prompt_len), device=s.device)
    cache = DynamicCache(config=model.config)
    with integration(s.paths[0], name):
        token = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

    def steps(fn: Callable, count: int) -> list[float]:
        step_cache = copy.deepcopy(cache)
        return [
            wall_seconds(lambda: fn(token, cache=step_cache, use_cache=True), s.device)
            for _ in range(count)
        ]

    # Three steps compile the first KV length, then the dynamic one, then run it.
    return Case(f"{name} decode B={batch} after {s.prompt_len}", "step time", "ms",
                warm_up=lambda fn: steps(fn, 3),
                one_round=lambda fn: statistics.median(steps(fn, s.steps)) * 1e3,
                faster_is_higher=False)  # fmt: skip


def measure_case(family: str, case: Case, paths: dict[str, Callable], s: Settings,
                 results: Results) -> None:  # fmt: skip
    """Warm every path up (compiles), then time ``s.rounds`` rotated rounds; add the rows."""
    errors: dict[str, str] = {}
    first_calls = {}
    for path, fn in paths.items():
        start = time.perf_counter()
        try:
            with integration(path, family):
                case.warm_up(fn)
        except Exception as error:
            errors[path] = f"{type(error).__name__}: {error}"
            continue
        first_calls[path] = time.perf_counter() - start

    def timed(path: str) -> Callable[[], float]:
        def one() -> float:
            with integration(path, family):
                return case.one_round(paths[path])

        return one

    values = rotated_rounds({path: timed(path) for path in paths if path not in errors},
                            s.rounds, timer=lambda one: one(), errors=errors,
                            deadline=s.deadline)  # fmt: skip
    results.add([
        row(case.name, path, case.metric, values[path], case.units, path=describe(path, s),
            first_calls_s=round(first_calls[path], 3))
        for path in paths if path in values
    ])  # fmt: skip
    for path, message in errors.items():
        results.environment.setdefault("errors", {}).setdefault(case.name, {})[path] = message
        print(f"  {case.name}: {path} failed: {message.splitlines()[0][:300]}", flush=True)
    results.write()
    print(table_row(case, {path: statistics.median(v) for path, v in values.items()}), flush=True)


def table_row(case: Case, medians: dict[str, float]) -> str:
    """The case's medians per path and kda-ops' speed-up over each other path."""
    cells = [f"{medians[p]:,.0f}" if p in medians and case.faster_is_higher
             else f"{medians[p]:.2f}" if p in medians else "-" for p in PATHS]  # fmt: skip
    ours = medians.get("kda-ops")
    for peer in ("fla", "torch.compile"):
        if ours is None or peer not in medians:
            cells.append("-")
        elif case.faster_is_higher:
            cells.append(f"{ours / medians[peer]:.2f}x")
        else:
            cells.append(f"{medians[peer] / ours:.2f}x")
    return f"| {case.name} | {case.units} | " + " | ".join(cells) + " |"


TABLE_HEADER = (
    "| case | units | " + " | ".join(PATHS) + " | kda-ops speed-up vs fla | vs torch.compile |\n|"
    + " --- |" * 2 + " ---: |" * (len(PATHS) + 2)
)  # fmt: skip


def stopped_at_deadline(results: Results, what: str) -> None:
    """Notes in the file and the log that the budget's deadline (0.9 of it) stopped the run
    between cases: ``budget of S s: WHAT``."""
    stopped = f"budget of {results.environment['settings']['budget_s']} s: {what}"
    results.environment["stopped"] = stopped
    results.write()
    print(stopped, flush=True)


def measure_family(name: str, s: Settings, results: Results) -> None:
    model = build(name, s)
    bindings = kernel_bindings(model)
    results.environment.setdefault("bindings", {})[name] = bindings
    # The config entries that differ from the family's defaults: the sizes timed.
    text_config = model.config.get_text_config().to_diff_dict()
    results.environment.setdefault("configs", {})[name] = text_config
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; "
          f"transformers bound {bindings}", flush=True)  # fmt: skip
    unbound = [a for a, b in bindings.items() if "delta" in a and not b.startswith("fla.")]
    if any(path in NEEDS_FLA for path in s.paths) and unbound:
        raise RuntimeError(
            f"{name}: transformers bound its PyTorch fallback, not FLA, for {unbound} "
            "(FLA failed to import when the model file was imported): the FLA rows would "
            "not time FLA"
        )
    paths = compiled(model, s)
    with torch.no_grad():
        for batch in s.batches:
            length = s.prefill_len if batch == 1 else s.prompt_len
            for make_case in (functools.partial(prefill_case, name, model, batch, length, s),
                              functools.partial(decode_case, name, model, batch, s)):  # fmt: skip
                if _past(s.deadline):
                    stopped_at_deadline(results, f"no more cases of {name}")
                    return
                measure_case(name, make_case(), paths, s, results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def positive(kind: type) -> Callable[[str], float]:
        def parse(text: str) -> float:
            value = kind(text)
            if value <= 0:
                raise argparse.ArgumentTypeError(f"must be positive, got {text}")
            return value

        return parse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", choices=[*FAMILIES, "all"], default=["all"],
                        help="model families, in order (default: all)")  # fmt: skip
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(DEFAULT_PATHS),
                        help="what to time (default: %(default)s)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="hidden 1024, short lengths")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' tiny configs, one round: a plumbing check")  # fmt: skip
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: float32, without the FLA paths (a plumbing check)")  # fmt: skip
    parser.add_argument("--batches", nargs="+", type=positive(int), default=[1, 64])
    parser.add_argument("--prefill-len", type=positive(int), help="T of the B = 1 prefill")
    parser.add_argument("--prompt-len", type=positive(int),
                        help="the decode prompt, and T of the prefill at B > 1")  # fmt: skip
    parser.add_argument("--steps", type=positive(int), help="decode steps a round")
    parser.add_argument("--rounds", type=positive(int), help="rounds of rotated order")
    parser.add_argument("--mode", help="torch.compile's mode for the compiled paths")
    parser.add_argument("--backend",
                        help="a dynamo backend for every compiled path instead of theirs "
                        "(aot_eager: the graphs without Inductor, a plumbing check)")  # fmt: skip
    parser.add_argument("--budget-s", type=positive(float),
                        help="stop within this many seconds, keeping finished cases")  # fmt: skip
    add_arguments(parser, "transformers_models")
    args = parser.parse_args(argv)
    if args.quick and args.tiny:
        parser.error("--quick and --tiny are two sizes: give one")
    if args.mode is not None and args.backend is not None:
        parser.error("--mode is for the Inductor backends; --backend replaces them")
    return args


def _alarm(signum: int, frame: object) -> None:
    raise BudgetSpent


@dataclasses.dataclass
class Progress:
    """Where the run is, for the message and the file when the budget stops it."""

    at: str = "set-up"
    results: Results | None = None


def run(args: argparse.Namespace, progress: Progress) -> None:
    s = settings(args)
    names = list(FAMILIES) if "all" in args.model else list(dict.fromkeys(args.model))
    check_environment(names, s)
    import transformers

    # Every path compiles each case's shapes against model.forward's one code object; a
    # path past the limit would run eagerly unnoticed, so raise it, and fail past it.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    results = progress.results = Results.from_args("transformers_models", args)
    results.environment["versions"]["transformers"] = transformers.__version__
    recorded = dataclasses.asdict(s) | {"dtype": str(s.dtype), "budget_s": args.budget_s}
    del recorded["deadline"]
    results.environment["settings"] = recorded
    results.write()
    print(f"{torch.cuda.get_device_name() if s.device == 'cuda' else 'cpu'}, {s.dtype}; "
          "tokens/s: median over rounds (higher is faster); ms: the median decode step",
          flush=True)  # fmt: skip
    print(TABLE_HEADER, flush=True)
    for name in names:
        if _past(s.deadline):
            stopped_at_deadline(results, f"not starting {name}")
            break
        progress.at = name
        try:
            measure_family(name, s, results)
        except Exception as error:  # this family cannot be timed as asked; the next may
            message = f"{type(error).__name__}: {error}"
            results.environment.setdefault("errors", {})[name] = message
            results.write()
            print(f"  {name} stopped: {message.splitlines()[0][:300]}", flush=True)
        torch._dynamo.reset()
        gc.collect()
        if s.device == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {results.path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    progress = Progress()
    if args.budget_s is not None:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, args.budget_s)
    try:
        run(args, progress)
    except BudgetSpent:
        stopped = f"budget of {args.budget_s} s spent during {progress.at}"
        if progress.results is not None:
            progress.results.environment["stopped"] = stopped
            progress.results.write()
        print(f"{stopped} ({time.monotonic() - started:.0f} s); every finished case is in "
              f"{args.out}", flush=True)  # fmt: skip
        # The interrupted call may leave compile workers or locks that an orderly exit
        # would wait on; what was measured is on disk.
        sys.stderr.flush()
        os._exit(0)
    signal.setitimer(signal.ITIMER_REAL, 0)


if __name__ == "__main__":
    main()
