"""The sampler in a process of its own: asynchronous RL across processes (#52).

With ``train.max_staleness = k >= 1`` and ``train.sampler_address = "host:port"``, ``gigrl-train``
trains on its own devices and listens at that address; a second process, the same command with
``--sampler``, connects and runs the sampler's half of every RL step
(:func:`gigrl.training.overlap.sample_step`: prompts from the query pool, rollout with search,
reward, the pool's rule) on its devices::

  gigrl-train --config C --workdir W --config.train.max_staleness=1 \\
      --config.train.sampler_address=localhost:5557 &
  gigrl-train --config C --workdir W --config.train.max_staleness=1 \\
      --config.train.sampler_address=localhost:5557 --sampler

The two are separate JAX programs (on a pod each would be its own cluster of hosts, joined by
``jax.distributed``; here each is one process). They share one TCP connection
(:mod:`multiprocessing.connection`, authenticated with ``$GIGRL_SAMPLER_KEY``, default
``gigrl``) and nothing else:

* trainer -> sampler: a :class:`Start` when RL starts (the first RL step, the params and their
  version, the query pool's state), then after each update its params (:class:`Params`: a host
  copy of every leaf: the weights move by host broadcast), then ``None`` to stop;
* sampler -> trainer: each RL step's :class:`gigrl.training.overlap.Rollout`, in step order, or
  a :class:`Failed` naming the sampler's error.

The sampler process runs :class:`gigrl.training.overlap.Sampler`, the schedule of the in-process
thread, so step ``s`` is sampled by exactly version ``max(0, s - 1 - sft_steps - k)``: a run is
as deterministic as a one-process run with the same k, and its metrics are the same (a test). A
receiving thread reads each version off the socket and puts it on the sampler's devices while
the sampler decodes, so new weights never stop the sampler; it waits only when the version a step
needs has not arrived yet (``time/sampler_idle_s``: the staleness bound at work).

The query pool lives in the sampler, which starts from the trainer's pool state (its
checkpoint's, on a resume). Each rollout carries the pool's state after it, which the trainer
checkpoints with the step it trains, as in one process. Faults: when either process dies the
other stops with an error naming the address; rerunning both resumes from the trainer's last
checkpoint, the rollouts that were in flight sampled again (none trained twice, none lost).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from multiprocessing import connection
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from etils import epath

from gigrl import search as search_lib
from gigrl.config_utils import ConfigError, UserError, host_port
from gigrl.training import build
from gigrl.training import evaluate as evaluate_lib
from gigrl.training import overlap
from gigrl.training import state as state_lib
from gigrl.training import warmup

CONNECT_TIMEOUT_S = 1800.0    # how long either side waits for the other to connect
ENV_KEY = "GIGRL_SAMPLER_KEY"


class SamplerError(UserError):
  """The sampler process and the trainer lost each other (one line, ``gigrl-train`` exit 2)."""


@dataclasses.dataclass
class Start:
  """Trainer -> sampler when RL starts: what the sampler's schedule and pool start from.

  Attributes:
    first_rl_step, last_step, sft_steps, max_staleness: :class:`overlap.Sampler`'s arguments.
    version: the params' version (RL updates so far); params: their leaves (host numpy arrays,
      ``jax.tree.leaves`` order of the trainer's params); pool_state: the query pool's
      :meth:`~gigrl.data.pool.QueryPool.state_dict`.
  """
  first_rl_step: int
  last_step: int
  sft_steps: int
  max_staleness: int
  version: int
  params: list
  pool_state: dict


@dataclasses.dataclass
class Params:
  """Trainer -> sampler after update ``version``: every leaf of the params, on the host."""
  version: int
  leaves: list


@dataclasses.dataclass
class Failed:
  """Sampler -> trainer: the sampler's error, in words."""
  message: str


def _authkey() -> bytes:
  return os.environ.get(ENV_KEY, "gigrl").encode()


def _host_leaves(params: Any) -> list[np.ndarray]:
  """Every leaf of ``params`` as a host array (the whole array, however it is sharded)."""
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(params))]


# ------------------------------------------------------------------------------- the trainer
def for_trainer(t, step: int, log: Callable[[str], None]):
  """The sampler of trainer ``t``'s RL steps from ``step`` on: a :class:`RemoteSampler` with
  ``train.sampler_address``, else :func:`gigrl.training.overlap.for_trainer`.

  Raises:
    ConfigError: naming ``train.sampler_address`` when the trainer runs on several processes,
      or its port cannot be listened on.
    SamplerError: no sampler process connected within :data:`CONNECT_TIMEOUT_S`.
  """
  cfg = t.cfg
  address = str(cfg.train.get("sampler_address", ""))
  if not address:
    return overlap.for_trainer(t, step, log)
  if jax.process_count() > 1:
    raise ConfigError("train.sampler_address", address, "'' when the trainer runs on several "
                      "processes (a sampler process serves a one-process trainer for now)")
  sft = int(cfg.train.sft_steps)
  start = Start(first_rl_step=step, last_step=sft + int(cfg.train.num_steps), sft_steps=sft,
                max_staleness=int(cfg.train.max_staleness), version=step - 1 - sft,
                params=_host_leaves(t.state.params), pool_state=t.pool.state_dict())
  return RemoteSampler(address, start, log)


class RemoteSampler:
  """The trainer's end of the connection, with :class:`overlap.Sampler`'s interface
  (:meth:`get`, :meth:`publish`, :meth:`paused`, :meth:`close`, ``k``).

  Args:
    address: ``host:port`` to listen at; start: the :class:`Start` to send; log: a line logger.
    timeout: seconds to wait for the sampler process to connect.
  """

  def __init__(self, address: str, start: Start, log: Callable[[str], None],
               timeout: float = CONNECT_TIMEOUT_S):
    self.address, self.k = address, int(start.max_staleness)
    # the newest version a step samples with: the last step's
    self.last_version = max(0, start.last_step - 1 - start.sft_steps - self.k)
    try:
      self.listener = connection.Listener(host_port("train.sampler_address", address),
                                          authkey=_authkey())
    except OSError as e:
      raise ConfigError("train.sampler_address", address,
                        f"an address this host can listen at ({e})") from None
    log(f"RL: waiting for the sampler process at {address} (the same gigrl-train command with "
        "--sampler)")
    got: list = []
    accept = threading.Thread(target=lambda: got.append(self._accept()), daemon=True)
    accept.start()
    accept.join(timeout)
    if not got or isinstance(got[0], BaseException):
      self.listener.close()
      why = f" ({got[0]})" if got else ""
      raise SamplerError(f"no sampler process connected to train.sampler_address={address} "
                         f"within {timeout:.0f} s{why}: start the same gigrl-train command with "
                         "--sampler")
    self.conn = got[0]
    log(f"RL: sampler process connected at {address}")
    self.conn.send(start)
    self.outbox: queue.Queue = queue.Queue()
    self.error: BaseException | None = None
    self.closed = False
    self.sender = threading.Thread(target=self._send_loop, name="gigrl-weights", daemon=True)
    self.sender.start()

  def _accept(self):
    try:
      return self.listener.accept()
    except BaseException as e:  # pylint: disable=broad-except
      return e

  def _send_loop(self) -> None:
    """Sends each published version (its device copy read to the host here, off the trainer's
    thread), then ``None``."""
    try:
      while True:
        item = self.outbox.get()
        if item is None:
          self.conn.send(None)
          return
        version, params = item
        self.conn.send(Params(version=version, leaves=_host_leaves(params)))
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def _lost(self, step: int) -> SamplerError:
    return SamplerError(f"the sampler process at train.sampler_address={self.address} closed "
                        f"the connection before RL step {step}: rerun both commands to resume "
                        "from the last checkpoint")

  def get(self, step: int) -> tuple[overlap.Rollout, float]:
    """RL step ``step``'s rollout from the sampler process, and the seconds waited for it.

    Raises:
      SamplerError: the sampler failed (its error named) or the connection was lost.
    """
    t0 = time.perf_counter()
    try:
      msg = self.conn.recv()
    except (EOFError, OSError):
      raise self._lost(step) from None
    if isinstance(msg, Failed):
      raise SamplerError(f"the sampler process at train.sampler_address={self.address} "
                         f"failed: {msg.message}")
    if not isinstance(msg, overlap.Rollout) or msg.step != step:
      raise RuntimeError(f"expected the rollout of RL step {step} from the sampler process, got "
                         f"{type(msg).__name__} {getattr(msg, 'step', '')}")
    return msg, time.perf_counter() - t0

  def publish(self, params, version: int) -> None:
    """Queues update ``version``'s params for the sampler (a device copy now: the next update
    donates the trainer's buffers; read to the host and sent by the sending thread).

    Raises:
      SamplerError: an earlier send failed (the connection was lost).
    """
    if self.error is not None:
      raise self._lost(int(version) + 1)
    if int(version) > self.last_version:     # no step is sampled with it
      return
    self.outbox.put((int(version), state_lib.copy(params)))

  def paused(self):
    """Nothing to hold: evaluations run on the trainer's devices and retriever."""
    return contextlib.nullcontext()

  def close(self) -> None:
    """Tells the sampler process to stop, and closes the connection (idempotent)."""
    if self.closed:
      return
    self.closed = True
    self.outbox.put(None)
    self.sender.join(timeout=60)
    self.conn.close()
    self.listener.close()


# ------------------------------------------------------------------------------- the sampler
class SamplerSide:
  """What :func:`overlap.sample_step` and :func:`warmup.warm_up_sampler` read of a trainer,
  built from the config in the sampler process (no optimizer, checkpoints or evaluator).

  ``workdir``: the sampler's own directory (its TFDS build), ``<trainer workdir>/sampler``.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: epath.Path,
               log: Callable[[str], None]):
    self.cfg = cfg
    data = build.load_data(cfg, workdir)
    self.tokenizer = data.tokenizer
    self.policy = build.build_policy(cfg, self.tokenizer.vocab_size, self.tokenizer)
    log(f"sampler: {self.policy.describe()}")
    self.retriever = search_lib.make_retriever(cfg.search)
    self.settings = build.rollout_settings(cfg)
    self.engine = build.rl_engine(cfg, self.policy, self.tokenizer, self.retriever)
    self.rl_questions = build.rl_questions(cfg.train, data.train, cfg.seed)
    self.pool = build.query_pool(cfg, len(self.rl_questions))
    self.eval_questions = evaluate_lib.select(data.eval, cfg.train.eval_questions)

  def put(self, leaves: list) -> Any:
    """Host leaves (:class:`Params`) -> params on this process's devices, in the training
    layout (:func:`overlap.sample_step` turns them into the rollout's)."""
    ref = self.policy.params
    shardings = [x.sharding for x in jax.tree.leaves(ref)]
    return jax.tree.unflatten(jax.tree.structure(ref), jax.device_put(list(leaves), shardings))


def _connect(address: str, timeout: float, log: Callable[[str], None]):
  """Connects to the trainer at ``address``, retrying until it listens (it starts listening when
  its RL starts: after its SFT steps and warm-up)."""
  deadline, said = time.monotonic() + timeout, 0.0
  while True:
    try:
      return connection.Client(host_port("train.sampler_address", address), authkey=_authkey())
    except (ConnectionRefusedError, FileNotFoundError, OSError) as e:
      if time.monotonic() > deadline:
        raise SamplerError(f"no trainer listened at train.sampler_address={address} within "
                           f"{timeout:.0f} s ({e}): start gigrl-train without --sampler") from None
      if time.monotonic() - said > 60:
        log(f"sampler: waiting for the trainer at {address}")
        said = time.monotonic()
      time.sleep(1.0)


def serve(cfg: ml_collections.ConfigDict, workdir: str | epath.PathLike,
          log: Callable[[str], None], timeout: float = CONNECT_TIMEOUT_S) -> int:
  """``gigrl-train --sampler``: builds the sampler, compiles its rollout programs, connects to
  the trainer at ``train.sampler_address`` and samples the RL steps it is sent, until the
  trainer stops it or its last step is sent.

  Returns:
    the number of rollouts sent.
  Raises:
    ConfigError: no ``train.sampler_address`` (or ``train.max_staleness = 0``: the config's own
      check). SamplerError: the trainer did not listen within ``timeout`` seconds.
  """
  address = str(cfg.train.get("sampler_address", ""))
  if not address:
    raise ConfigError("train.sampler_address", address, "host:port of the trainer (gigrl-train "
                      "--sampler samples for a trainer that listens there)")
  side = SamplerSide(cfg, epath.Path(workdir) / "sampler", log)
  warmup.warm_up_sampler(side, side.eval_questions, log)
  conn = _connect(address, timeout, log)
  sent = 0
  try:
    try:
      start = conn.recv()
    except (EOFError, OSError):
      raise SamplerError(f"the trainer at {address} closed the connection") from None
    side.pool.load_state_dict(start.pool_state)
    sampler = overlap.Sampler(
        lambda s, params, v: overlap.sample_step(side, s, params, v, log),
        max_staleness=start.max_staleness, first_rl_step=start.first_rl_step,
        last_step=start.last_step, sft_steps=start.sft_steps, params=start.params,
        version=start.version, copy=side.put)
    log(f"sampler: RL steps {start.first_rl_step}-{start.last_step} from version "
        f"{start.version}, k = {start.max_staleness}")

    def receive() -> None:       # the weights, put on this process's devices as they come
      try:
        while (msg := conn.recv()) is not None:
          sampler.publish(msg.leaves, msg.version)
      except (EOFError, OSError):
        pass
      sampler.stop()            # the trainer is done (or gone): stop after the current step

    receiver = threading.Thread(target=receive, name="gigrl-weights", daemon=True)
    receiver.start()
    failed = True
    try:
      for step in range(start.first_rl_step, start.last_step + 1):
        try:
          r, _ = sampler.get(step)
        except overlap.Stopped:
          break
        conn.send(r)
        sent += 1
        log(f"sampler: step {step} sampled by version {r.version} in {r.t_roll:.1f} s "
            f"(waited {r.idle_s:.1f} s for it)")
      failed = False
    except BaseException as e:
      with contextlib.suppress(Exception):
        conn.send(Failed(f"{type(e).__name__}: {e}"))
      raise
    finally:
      sampler.close()
      # until the trainer says stop: closing first (with its weights unread) would reset the
      # connection and drop the rollouts the trainer has not read yet
      receiver.join(None if not failed else 60)
  finally:
    conn.close()
  return sent
