"""``python -m benchmarks.suite``: see the package docstring, or ``--help``."""
import os
import sys

if __package__ in (None, ""):  # run as ``python benchmarks/suite``: make the packages importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.suite.cli import main  # noqa: E402

main()
