"""Only the C part of the build; everything else is in pyproject.toml.

s2s_flow/_handoff.c is the rings' GIL hand-over. It is optional: without a C compiler the
install still succeeds and s2s_flow/rings.py uses its pure-Python stand-in.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("s2s_flow._handoff", ["s2s_flow/_handoff.c"], optional=True)])
