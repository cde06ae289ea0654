"""Check our QDP definitions with NVIDIA's own ``tensorrt.plugin`` Python code, without
TensorRT's compiled bindings.

``python tools/trt_validate.py SOURCE``: SOURCE is a clone (or bare git dir) of
NVIDIA/TensorRT, or the directory holding its ``tensorrt/plugin/_validate.py``. Its
``tensorrt/plugin`` modules are read from there at run time (none is copied here) and
imported on top of a stub ``tensorrt`` module that has only what they touch at import and
registration time: enums of TensorRT's member names, and any other name as an empty class.

Then, with NVIDIA's ``register`` / ``autotune`` / ``aot_impl`` decorators (their
validators, ``_validate.py``), ``lowering.tensorrt_plugins.register_plugins()`` runs; per
plugin, NVIDIA's ``AutoTuneCombination`` expands our autotune string, and NVIDIA's plugin
creator converts attribute fields typed as the ONNX parser types them (FLOAT32 / INT32
arrays) into the values our ``aot_impl`` receives. Prints one line per check; exit 1 if
any fails. Nothing here runs a kernel or needs a GPU.
"""

from __future__ import annotations

import argparse
import enum
import importlib.machinery
import pathlib
import subprocess
import sys
import traceback
import types

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLUGIN_DIR = "python/packaging/bindings_wheel/tensorrt/plugin"
# Import order: each module's relative imports come before it.
MODULES = ("_export", "_utils", "_autotune", "_tensor", "_top_level", "_validate",
           "_plugin_class", "_lib")  # fmt: skip


def reader(source: pathlib.Path):
    """A function: module name -> its source text, from a git dir, a work tree, or the
    plugin directory itself."""
    for folder in (source, source / PLUGIN_DIR, source / "tensorrt" / "plugin"):
        if (folder / "_validate.py").is_file():
            return lambda module: (folder / f"{module}.py").read_text()
    if source.is_file() and source.name == "_validate.py":
        return lambda module: (source.parent / f"{module}.py").read_text()

    def from_git(module: str) -> str:
        ref = f"HEAD:{PLUGIN_DIR}/{module}.py"
        return subprocess.run(["git", "--git-dir", str(source), "show", ref], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip

    return from_git


class _Anything(type):
    """Metaclass of the stub's classes: any missing class attribute is another stub class,
    any call takes any arguments."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(cls, name, value)
        return value


def stub_tensorrt() -> types.ModuleType:
    """The stub: TensorRT's enum member names where NVIDIA's code compares or looks them
    up, a plugin registry that records creators, and stub classes for everything else."""
    trt = types.ModuleType("tensorrt")
    trt.__path__ = []  # a package, so that `tensorrt.plugin` imports
    anything = _Anything("tensorrt", (), {})
    trt.__getattr__ = lambda name: getattr(anything, name)
    names = {
        "DataType": "FLOAT HALF INT8 INT32 BOOL UINT8 FP8 BF16 INT64 INT4 FP4 E8M0",
        "PluginFieldType": "FLOAT16 FLOAT32 FLOAT64 INT8 INT16 INT32 CHAR DIMS UNKNOWN BF16 "
                           "INT64 FP8 INT4 FP4",
        "TensorFormat": "LINEAR CHW2 HWC8 CHW4 CHW16 CHW32 DHWC8 CDHW32 HWC DLA_LINEAR "
                        "DLA_HWC4 HWC16 DHWC",
        "QuickPluginCreationRequest": "UNKNOWN PREFER_JIT PREFER_AOT STRICT_JIT STRICT_AOT",
        "TensorRTPhase": "BUILD RUNTIME",
        "PluginArgType": "INT",
        "PluginArgDataType": "INT8 INT16 INT32",
    }  # fmt: skip
    for enum_name, members in names.items():
        setattr(trt, enum_name, enum.Enum(enum_name, members.split()))
    types_ = trt.DataType
    trt.float32, trt.float16, trt.bfloat16 = types_.FLOAT, types_.HALF, types_.BF16
    creators = {}

    class Registry:
        def register_creator(self, creator, namespace):
            creators[namespace, creator.name] = creator
            return True

        def get_creator(self, name, version, namespace):
            return creators[namespace, name]

    registry = Registry()
    trt.get_plugin_registry = lambda: registry
    return trt


def load_plugin_package(read) -> types.ModuleType:
    """NVIDIA's ``tensorrt.plugin`` modules, executed from their source over the stub."""
    sys.modules["tensorrt"] = stub_tensorrt()
    package = types.ModuleType("tensorrt.plugin")
    package.__path__, package.__package__ = [], "tensorrt.plugin"
    sys.modules["tensorrt.plugin"] = sys.modules["tensorrt"].plugin = package
    for name in MODULES:
        full = f"tensorrt.plugin.{name}"
        module = types.ModuleType(full)
        module.__package__ = "tensorrt.plugin"
        module.__spec__ = importlib.machinery.ModuleSpec(full, None)
        sys.modules[full] = module
        exec(compile(read(name), f"<NVIDIA {full}>", "exec"), module.__dict__)
        setattr(package, name, module)
    return package


# Attribute values as plugin-mode ONNX writes them (one call of each plugin).
DELTA_ATTRIBUTES = dict(scale=0.125, lower_bound=-5.0, use_gate=1, use_lower_bound=1,
                        use_qk_l2norm=1, use_beta_sigmoid=0)  # fmt: skip
ATTRIBUTES = {"chunk_recurrence": {}, "causal_conv1d_output": dict(silu=1),
              "causal_conv1d_state": {}, "gated_rms_norm": dict(eps=1e-6, silu=0),
              "gate": dict(lower_bound=-5.0, use_lower_bound=1)}  # fmt: skip


def onnx_parser_fields(attrs: dict) -> list:
    """Attribute fields as the ONNX parser hands them over: float -> FLOAT32, int -> INT32
    one-element arrays, whatever type the creator declares."""
    fields = []
    for key, value in attrs.items():
        dtype = np.float32 if isinstance(value, float) else np.int32
        fields.append(types.SimpleNamespace(name=key, data=np.array([value], dtype=dtype)))
    return fields


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=pathlib.Path, help="NVIDIA/TensorRT git dir or tree")
    read = reader(parser.parse_args().source)
    sys.path.insert(0, str(ROOT))
    failures = 0

    def check(label: str, fn) -> object:
        nonlocal failures
        try:
            result = fn()
        except Exception:  # report every check, then fail
            failures += 1
            print(f"FAIL {label}\n{traceback.format_exc()}")
            return None
        print(f"ok   {label}")
        return result

    trtp = check("NVIDIA tensorrt.plugin imports over the stub", lambda: load_plugin_package(read))
    if trtp is None:
        return 1
    from lowering import tensorrt_plugins as qdp

    check("register / autotune / aot_impl pass NVIDIA's validators",
          qdp.register_plugins)  # fmt: skip
    lib = trtp._lib
    for name, spec in qdp.SPECS.items():
        plugin_id = f"{qdp.NAMESPACE}::{name}"
        definition = lib.QDP_REGISTRY.get(plugin_id)
        if definition is None:
            failures += 1
            print(f"FAIL {plugin_id}: not registered")
            continue
        io = len(spec.kernel.inputs) + len(spec.outputs)

        def schema(d=definition, spec=spec):
            assert d.input_tensor_names == list(spec.kernel.inputs), d.input_tensor_names
            assert list(d.input_attrs) == list(spec.attributes), d.input_attrs
            assert d.num_outputs == len(spec.outputs), d.num_outputs
            assert d.aot_impl_attr_names == list(spec.attributes), d.aot_impl_attr_names

        label = f"{plugin_id}: schema {definition.input_tensor_names} {list(spec.attributes)}"
        check(label, schema)

        def combinations(d=definition, io=io):
            (combination,) = d.autotune_func()
            expanded = combination._get_combinations()
            assert all(len(c.types) == io for c in expanded), [len(c.types) for c in expanded]
            return [[t.name for t in c.types] for c in expanded]

        combos = check(f"{plugin_id}: autotune combinations expand ({io} I/O)", combinations)
        if combos:
            print("       " + " / ".join(",".join(c) for c in combos))
        attrs = ATTRIBUTES.get(name, DELTA_ATTRIBUTES)

        def attributes(name=name, attrs=attrs, plugin_id=plugin_id):
            creator = lib.QDP_CREATORS[f"{qdp.NAMESPACE}::{name}"]
            request = sys.modules["tensorrt"].QuickPluginCreationRequest.STRICT_AOT
            plugin = creator.create_plugin(name, qdp.NAMESPACE, onnx_parser_fields(attrs),
                                           None, request)  # fmt: skip
            parsed = qdp.parse_attributes(name, list(plugin.attrs.values()))
            for key, value in attrs.items():
                assert parsed[key] == qdp.SPECS[name].attributes[key](np.float32(value)), key
            shuffled = creator.create_plugin(name, qdp.NAMESPACE,
                                             onnx_parser_fields(dict(sorted(attrs.items()))),
                                             None, request)  # fmt: skip
            if list(shuffled.attrs) != list(attrs):
                print(
                    f"note {plugin_id}: fields in another order reach aot_impl in that "
                    f"order (positional): {list(shuffled.attrs)}"
                )
            return parsed

        if spec.attributes:
            check(f"{plugin_id}: FLOAT32 / INT32 attribute fields -> our attributes",
                  attributes)  # fmt: skip
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
