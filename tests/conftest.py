import os
import pathlib
import shutil
import subprocess

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter
    # (set before kda_ops imports them; fp32 only: its bf16 tl.dot is broken).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def runner(tmp_path_factory) -> pathlib.Path:
    """The C++ runner of examples/aoti_runner, built against this torch's libtorch."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("the C++ runner needs cmake and a C++ compiler")
    build = tmp_path_factory.mktemp("aoti_runner")
    source = pathlib.Path(__file__).resolve().parents[1] / "examples" / "aoti_runner"
    configure = ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"]  # fmt: skip
    configured = subprocess.run(configure, capture_output=True, text=True)
    if configured.returncode and torch.version.cuda and "find the CUDA" in configured.stderr:
        pytest.skip("libtorch of a CUDA build of torch configures only with the CUDA toolkit")
    assert configured.returncode == 0, configured.stderr
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    return build / "kda_aoti_runner"
