"""Envoy as encoderd's REST gateway: config rendering and the supervised child process."""
