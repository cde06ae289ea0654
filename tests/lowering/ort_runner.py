"""Run ONNX models in onnxruntime and compare with saved expectations, without torch.

``python ort_runner.py CASES_DIR``: every ``*.npz`` there holds ``model`` (the .onnx path),
``in.<name>`` inputs and ``out.<name>`` expected outputs. Exits non-zero on a mismatch and
prints ``ok <n> cases`` otherwise. Fails if torch got imported along the way.
"""

import pathlib
import sys

import numpy as np
import onnxruntime as ort


def run_case(path: pathlib.Path) -> None:
    case = np.load(path)
    session = ort.InferenceSession(str(case["model"]), providers=["CPUExecutionProvider"])
    feeds = {key[3:]: case[key] for key in case.files if key.startswith("in.")}
    names = [output.name for output in session.get_outputs()]
    for name, got in zip(names, session.run(names, feeds)):
        expected = case[f"out.{name}"]
        assert got.shape == expected.shape and got.dtype == expected.dtype, (path.name, name)
        # torch.testing.assert_close's float32 defaults; exact for integers
        np.testing.assert_allclose(got, expected, rtol=1.3e-6, atol=1e-5, err_msg=name)


def main() -> None:
    cases = sorted(pathlib.Path(sys.argv[1]).glob("*.npz"))
    assert cases, "no cases"
    for path in cases:
        run_case(path)
    assert "torch" not in sys.modules, "the runner must not import torch"
    print(f"ok {len(cases)} cases")


if __name__ == "__main__":
    main()
