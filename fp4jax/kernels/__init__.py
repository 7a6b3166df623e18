"""Pallas (Triton backend) kernels; each module: _<op>_kernel -> _<op>_call -> <op> -> <op>_reference."""
