"""Shared fixtures: real servers and models built locally (see tests/support/)."""

pytest_plugins = ["tests.support.fixtures"]
