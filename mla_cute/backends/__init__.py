"""Backends: ``reference`` (pure torch, the specification) and ``cute`` (CuTe DSL kernels on SM90)."""
