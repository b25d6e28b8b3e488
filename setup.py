"""Build kt_ops: the Python package plus one C++ extension, kt_ops._C.

The extension holds the op schemas (csrc/ops/registration.cpp), the CPU code of csrc/ by layer
(platform/, kernels/, gemm/, ops/) and the Meta/fake kernels (meta_kernels/). Build it against
the torch already installed, without pip's build isolation:

    pip install --no-build-isolation -e .
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob("csrc/*/*.cpp")) + sorted(glob.glob("meta_kernels/*.cpp"))

setup(
    name="kt_ops",
    version="0.1.0",
    description="torch.library custom ops for MoE fine-tuning with CPU-resident experts",
    # The product layout keeps the shape functions in meta_kernels/; the Python fakes there are
    # the package kt_ops.meta_kernels (kt_ops/__init__.py finds them in a source tree too).
    package_dir={"kt_ops.meta_kernels": "meta_kernels"},
    packages=["kt_ops", "kt_ops.meta_kernels", "kt_ops.hf", "kt_ops.data", "kt_ops.finetune", "kt_ops.finetune.data"],
    package_data={"kt_ops.finetune.data": ["corpus.txt", "preferences.jsonl"]},  # the demo corpus and DPO pairs
    python_requires=">=3.10",
    install_requires=["torch==2.13.0"],
    # KT_OPS_SKIP_EXTENSION=1: the package alone (scripts/setup.sh builds the extension in place
    # first, incrementally, and then installs the package editable without building it again).
    ext_modules=[] if os.environ.get("KT_OPS_SKIP_EXTENSION") == "1" else [
        CppExtension(
            "kt_ops._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            # at::parallel_for is header-inline OpenMP: without -fopenmp it runs serially.
            extra_compile_args={"cxx": ["-O3", "-fopenmp", "-DPy_LIMITED_API=0x03090000"]},
            extra_link_args=["-fopenmp"],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    entry_points={"console_scripts": ["kt-finetune = kt_ops.finetune:main"]},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
