"""Commands beside training: the benchmark, the estimator, export (torch and ONNX) and the run report."""
