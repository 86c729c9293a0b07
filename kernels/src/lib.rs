//! maxc-kernels: the kernel IR, the kernel library and its reference interpreter.
