"""What the compiler stack does with the ``kda`` ops: Inductor fusion passes, export with
explicit state, ONNX translation and TensorRT plugins (one module each, as they land)."""
