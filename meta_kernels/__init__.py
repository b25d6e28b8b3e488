"""Shape functions of the kt ops: C++ Meta kernels (*.cpp, compiled into kt_ops._C) and
Python fake kernels (*.py, imported as kt_ops.meta_kernels)."""
from kt_ops.meta_kernels import collectives, linear, shard_collectives  # noqa: F401
