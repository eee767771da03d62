"""The CPU's own kernels, in one place:

    extension.py        builds and loads the C++ kernels of csrc/ (AVX2/AVX-512 where the machine has them)
                        and registers them as torch ops with fake implementations, so they compile
    quant_gemv.py       quantized GEMV/GEMM launchers over the C++ kernels (the weight-only layers' "native")
    quant_panels.py     the AVX-512 VNNI quantized GEMM over row panels (the weight-only layers' "panels")
    paged_attention.py  paged decode attention over the C++ kernel
    packed_gemm.py      torch's packed int8/int4 CPU GEMMs: when each is eligible and faster (measured)
"""
