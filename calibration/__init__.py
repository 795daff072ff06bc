"""INT8 calibration: one batch iterator over real data, feeding ONNX Runtime (and TensorRT's legacy path)."""
