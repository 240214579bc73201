"""CuTe DSL kernels for Hopper (imported as ``mla_cute.kernels``), one file per kernel.

Importing this package does not import the DSL; each kernel module does.
"""
