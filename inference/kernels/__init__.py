"""The target's verification kernels: compiled forwards, the direct forward, its C++ layers, packed GEMM and
the screened greedy head, each bitwise or token-identical to the model's own forward."""

# The runtime's choices for the target's linears, fastest first where each exists (packed_gemm.py);
# here, free of torch, so the CLI can offer them without importing it.
LINEAR_KERNELS = ("auto", "stream", "onednn", "mkl", "default")  # auto: stream or onednn, timed per machine
