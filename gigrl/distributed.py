"""Multi-host (SPMD, one process per host) start-up and the few host-side collectives a run needs.

Start-up (:func:`initialize`, called by ``gigrl-train`` before anything touches a device):

* explicit: ``--coordinator_address`` / ``--num_processes`` / ``--process_id`` flags, or the
  ``GIGRL_COORDINATOR`` / ``GIGRL_NUM_PROCESSES`` / ``GIGRL_PROCESS_ID`` environment variables
  (CPU tests, GPU or other clusters). On CPU the collectives go through gloo
  (``jax_cpu_collectives_implementation``), set before ``jax.distributed.initialize``;
* automatic on a multi-host Cloud TPU VM (``TPU_WORKER_HOSTNAMES`` lists several hosts, or
  ``GIGRL_DISTRIBUTED=1``): ``jax.distributed.initialize()`` finds the coordinator itself.

Collectives (each is a no-op on one process, and every process must call it, in the same order):
:func:`barrier`, :func:`any_process` (the preemption agreement), :func:`gather_rows`,
:func:`agree_max`, :func:`gather_objects`, :func:`gather_batch` (a process's rollout rows -> the
global rollout batch on every host), :func:`gather_owned` (each item from the process that owns
it), :func:`reduce_metrics`; they move padded bytes, in a few program shapes that
:func:`warm_up_gathers` compiles before step 1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Any, Mapping, Sequence

import jax
import numpy as np

ENV_COORDINATOR = "GIGRL_COORDINATOR"
ENV_NUM_PROCESSES = "GIGRL_NUM_PROCESSES"
ENV_PROCESS_ID = "GIGRL_PROCESS_ID"


def _tpu_multihost() -> bool:
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return os.environ.get("GIGRL_DISTRIBUTED", "") not in ("", "0") or "," in hosts


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Joins the run's processes (``jax.distributed.initialize``) when there are several.

  Arguments left None are read from ``GIGRL_COORDINATOR`` (``host:port``),
  ``GIGRL_NUM_PROCESSES`` and ``GIGRL_PROCESS_ID``. Without a coordinator, a multi-host TPU VM
  (:func:`_tpu_multihost`) initialises from the TPU metadata; anything else stays one process.

  jax's coordination service lives in process 0: when that process dies, jax aborts every other
  process at once (SIGABRT, "Terminating process because the JAX distributed service detected
  fatal errors"). That abort cannot be turned into gigrl's one-line error: the client's error
  callback (jaxlib's ``missed_heartbeat_callback``) cannot receive its status in Python (tried
  with jaxlib 0.10.2: ``std::bad_cast``, then the same abort).

  Returns:
    True if ``jax.distributed.initialize`` was called.
  Raises:
    ValueError: a coordinator without a process count and id (or the reverse).
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
  if num_processes is None and env.get(ENV_NUM_PROCESSES):
    num_processes = int(env[ENV_NUM_PROCESSES])
  if process_id is None and env.get(ENV_PROCESS_ID):
    process_id = int(env[ENV_PROCESS_ID])
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise ValueError(f"--coordinator_address {coordinator_address} needs --num_processes and "
                       f"--process_id (or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})")
    if num_processes == 1:
      return False
    # CPU devices need gloo for cross-process collectives (ignored by TPU / GPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return True
  if num_processes not in (None, 1) or process_id not in (None, 0):
    raise ValueError("--num_processes / --process_id need --coordinator_address (or "
                     f"{ENV_COORDINATOR})")
  if _tpu_multihost():
    jax.distributed.initialize()
    return True
  return False


_peer_lost = {"lost": False}


def mark_peer_lost() -> None:
  """Records that another process of this cluster is gone (killed, or its connection lost).

  After that, jax's shutdown at exit would wait at a barrier for the lost process (until
  ``heartbeat_timeout_seconds``, 100 s) and then abort the survivor with a fatal dump;
  :func:`exit_if_peer_lost` ends the process at once instead."""
  _peer_lost["lost"] = True


# What a failed collective says when another process is gone: gloo's transport (CPU), the
# coordination service's verdict (any backend).
_LOST_SIGNS = ("Connection reset by peer", "Connection closed by peer", "heartbeat timeout",
               "stopped sending heartbeats")


def lost_process(err: BaseException | None) -> bool:
  """True when ``err`` (or an exception in its ``__cause__`` / ``__context__`` chain) says that
  another process of this run is gone (a collective's peer reset its connection, or the
  coordination service missed its heartbeats); it then calls :func:`mark_peer_lost`. The
  error's type does not matter: jax raises gloo's failure as a ``JaxRuntimeError`` from a
  compiled collective and as a ``ValueError`` from ``multihost_utils.process_allgather``. False
  on one process, and for any other error (a device's own failure keeps its traceback)."""
  seen = set()
  while err is not None and id(err) not in seen and jax.process_count() > 1:
    if isinstance(err, Exception) and any(m in str(err) for m in _LOST_SIGNS):
      mark_peer_lost()
      return True
    seen.add(id(err))
    err = err.__cause__ or err.__context__
  return False


def lost_process_message(err: BaseException) -> str:
  """The first half of the one-line error for :func:`lost_process`'s ``err``: which process saw
  which collective fail (its message's first line); the caller adds what to rerun."""
  first = str(err).strip().splitlines()[0] if str(err).strip() else ""
  return (f"process {jax.process_index()}: a collective of the {jax.process_count()} "
          f"processes failed ({type(err).__name__}: {first}), so one of them is gone")


def peer_was_lost() -> bool:
  """Whether :func:`mark_peer_lost` was called (then no wait on the other processes can end)."""
  return _peer_lost["lost"]


def exit_if_peer_lost(status: int) -> None:
  """Exits with ``status`` now, without jax's distributed shutdown (or other ``atexit``
  handlers), if :func:`mark_peer_lost` was called; returns otherwise. stdout and stderr are
  flushed first. Call it after the one-line error is printed."""
  if _peer_lost["lost"]:
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(Exception):
        stream.flush()
    os._exit(status)  # pylint: disable=protected-access


def is_main() -> bool:
  """True on process 0, the one process that writes run files (metrics, samples, plots)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier ``name``."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
  """True if ``flag`` is True on any process (an all-reduce max of one bit).

  Every process calls it once per step with its own stop request, so a SIGTERM that reached
  one host only makes every host stop after the same step.
  """
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(gather_rows(np.asarray([bool(flag)]))))


def agree_max(x: int) -> int:
  """The largest ``x`` over processes (every process takes the same static size)."""
  if jax.process_count() == 1:
    return int(x)
  return int(np.max(gather_rows(np.asarray([int(x)], np.int64))))


# Host gathers move bytes, padded to a power of two of at least 4 KiB: jax's process_allgather
# compiles one program per shape, so whatever arrays and lists a step gathers, they run one of a
# few programs, which :func:`warm_up_gathers` compiles before step 1 (#50: no compile in a step).
GATHER_MIN_BYTES = 1 << 12


def gather_bucket(nbytes: int) -> int:
  """The padded size, in bytes, of a host gather of ``nbytes`` bytes."""
  return max(GATHER_MIN_BYTES, 1 << max(int(nbytes) - 1, 0).bit_length())


def _gather_bytes(data: np.ndarray, size: int) -> np.ndarray:
  """u8[processes, size]: every process's ``data`` (u8[n], n <= ``size``, zero-padded), in
  process order."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  buf = np.zeros((1, size), np.uint8)
  buf[0, :data.size] = data
  return np.asarray(multihost_utils.process_allgather(buf, tiled=True))


def warm_up_gathers(max_bytes: int) -> int:
  """Runs a host gather of every padded size up to :func:`gather_bucket` of ``max_bytes`` (zeros),
  so that none compiles inside a step; a collective (every process calls it, at the same point).
  Returns the number of sizes (0 on one process)."""
  if jax.process_count() == 1:
    return 0
  size, n = GATHER_MIN_BYTES, 0
  while size <= gather_bucket(max_bytes):
    _gather_bytes(np.zeros(0, np.uint8), size)
    size, n = size * 2, n + 1
  return n


def process_rows(num_rows: int) -> slice:
  """The slice of ``num_rows`` global rows this process owns (contiguous, in process order).

  Raises:
    ValueError: ``num_rows`` is not divisible by the process count.
  """
  n, i = jax.process_count(), jax.process_index()
  if num_rows % n:
    raise ValueError(f"{num_rows} rows cannot be split evenly over {n} processes")
  per = num_rows // n
  return slice(i * per, (i + 1) * per)


def gather_rows(x: np.ndarray) -> np.ndarray:
  """Concatenates every process's ``x`` (same shape and dtype on each) along dim 0, in process
  order (a 0-d ``x``: stacked, [processes]). Exact: the bytes move, padded to
  :func:`gather_bucket`."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x
  flat = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
  parts = [np.frombuffer(p[:flat.size].tobytes(), x.dtype).reshape(x.shape)
           for p in _gather_bytes(flat, gather_bucket(flat.size))]
  return np.concatenate(parts, axis=0) if x.ndim else np.stack(parts)


def fetch(x: Any) -> np.ndarray:
  """A (possibly multi-host, e.g. batch-sharded) ``jax.Array`` as a whole host numpy array on
  every process (``np.asarray`` fails on arrays spanning other hosts' devices)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_objects(items: Sequence[Any]) -> list[Any]:
  """Concatenates every process's JSON-serialisable list, in process order (lengths may
  differ); the lists travel as padded UTF-8 byte arrays."""
  if jax.process_count() == 1:
    return list(items)
  data = np.frombuffer(json.dumps(list(items)).encode("utf-8"), np.uint8)
  sizes = gather_rows(np.asarray([data.size], np.int64))
  parts = _gather_bytes(data, gather_bucket(int(sizes.max())))
  out: list[Any] = []
  for part, size in zip(parts, sizes):
    out += json.loads(part[:int(size)].tobytes().decode("utf-8"))
  return out


def gather_batch(batch: Any, skip: Sequence[str] = ()) -> Any:
  """A dataclass of per-row fields (e.g. ``TrajectoryBatch``: numpy arrays and per-row lists)
  with every process's rows, in process order: the global batch, the same on every host.

  Fields named in ``skip`` are not exchanged and come back as None (a trainer that reads them
  on each host's own rows only, e.g. the strings, leaves them out)."""
  if jax.process_count() == 1:
    return batch
  fields = {}
  for f in dataclasses.fields(batch):
    v = getattr(batch, f.name)
    if f.name in skip:
      fields[f.name] = None
    else:
      fields[f.name] = gather_rows(v) if isinstance(v, np.ndarray) else gather_objects(v)
  return dataclasses.replace(batch, **fields)


def gather_owned(x: np.ndarray, owner: np.ndarray) -> np.ndarray:
  """Item ``k`` of ``x`` from process ``owner[k]``: each process fills in the items it owns
  (e.g. the anchor ids of the groups whose rows it holds), every process gets them all.

  Args:
    x: [K, ...] this process's values (only the items it owns are read).
    owner: int[K] owning process of each item (the same on every process).
  Returns:
    [K, ...] like ``x``; ``x`` itself on one process.
  """
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x
  every = gather_rows(x[None])                                   # [processes, K, ...]
  return every[np.asarray(owner), np.arange(x.shape[0])]


def reduce_metrics(metrics: Mapping[str, float], *, maximum: Sequence[str] = ()
                   ) -> dict[str, float]:
  """Sums each metric over processes (counts); keys in ``maximum`` (wall times) take the
  maximum. Every process must pass the same keys."""
  keys = sorted(metrics)
  if jax.process_count() == 1:
    return {k: float(metrics[k]) for k in keys}
  vals = gather_rows(np.asarray([[float(metrics[k]) for k in keys]], np.float64))
  return {k: float(vals[:, i].max() if k in maximum else vals[:, i].sum())
          for i, k in enumerate(keys)}
