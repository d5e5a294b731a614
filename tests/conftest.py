"""pytest setup: 8 simulated CPU devices for the sharding tests.

XLA reads the flag once, when the backend starts, so it is set here before any
test module imports jax.
"""
import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
