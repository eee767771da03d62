"""The CPU's own kernels, in one place:

    bindings.py         the C++ kernels' ops, declared once: schemas, result shapes (fakes), C entry points
    builds.py           their builds per instruction set, and the C++ registrations generated from bindings.py
    extension.py        loads the build this CPU runs best (or compiles one on first use) and registers the
                        ops' fake implementations, so they compile
    quant_gemv.py       quantized GEMV/GEMM launchers over the C++ kernels (the weight-only layers' "native")
    quant_panels.py     the AVX-512 VNNI quantized GEMM over row panels (the weight-only layers' "panels")
    paged_attention.py  paged decode attention over the C++ kernel
    packed_gemm.py      torch's packed int8/int4 CPU GEMMs: when each is eligible and faster (measured)
"""
