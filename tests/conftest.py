"""Root conftest: only the guest harness plugin (fixtures live in tests/fixtures_*.py)."""

pytest_plugins = ["aioublk.testing.pytest_plugin"]
