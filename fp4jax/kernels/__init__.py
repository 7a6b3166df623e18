"""Pallas kernels (Triton backend; mosaic_gemm: Mosaic GPU); each module: _<op>_kernel -> _<op>_call -> <op> -> <op>_reference."""
