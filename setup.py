"""Only the C part of the build; everything else is in pyproject.toml.

s2s_flow/_rings.c is the rings (put, wait, the GIL hand-over), s2s_flow/_trace.c the trace's
per-batch updates. Both are optional: without a C compiler the install still succeeds and
s2s_flow/rings.py and s2s_flow/trace.py use their pure-Python stand-ins.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"s2s_flow.{name}", [f"s2s_flow/{name}.c"], optional=True)
                   for name in ("_rings", "_trace")])
