"""The target's verification kernels: compiled forwards, the direct forward, its C++ layers, packed GEMM and
the screened greedy head, each bitwise or token-identical to the model's own forward."""
