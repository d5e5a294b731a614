"""The sampler in a process of its own: asynchronous RL across processes (#52).

With ``train.max_staleness = k >= 1`` and ``train.sampler_address = "host:port"``, a sampler
process (``gigrl-train --sampler``, the same config) listens at that address and runs the
sampler's half of every RL step (:func:`gigrl.training.overlap.sample_step`: prompts from the
query pool, rollout with search, reward, the pool's rule) on its own devices; the trainer
(``gigrl-train`` without the flag, on one process or on several joined by ``jax.distributed``)
connects to it, one connection per trainer process, and trains::

  gigrl-train --config C --workdir W --config.train.max_staleness=1 \\
      --config.train.sampler_address=localhost:5557 --sampler &
  gigrl-train --config C --workdir W --config.train.max_staleness=1 \\
      --config.train.sampler_address=localhost:5557

The sampler and the trainer are separate JAX programs: every process of one JAX cluster must
issue the same programs in the same order, and two halves running at their own pace do not.
They share the TCP connections (:mod:`multiprocessing.connection`, authenticated with
``$GIGRL_SAMPLER_KEY``, default ``gigrl``) and nothing else:

* each trainer process -> sampler: a :class:`Hello` (its process index and the count), then
  (process 0 only) a :class:`Start` when RL starts (the first RL step and the schedule's
  arguments, the query pool's state); then the params RL starts from and, after each update, the
  new ones, as :class:`Params`: the process's own shards of every leaf, read to its host (no
  collective: each host sends what it holds, one copy of each shard over the cluster); then
  ``None`` to stop, or a :class:`Failed` when the trainer process exits with an error (the
  sampler then exits 2 naming it, not 0). The sampler assembles a version when every trainer
  process's shards of it have arrived: the weights move by host broadcast, in pieces.
* sampler -> every trainer process: each RL step's :class:`gigrl.training.overlap.Rollout`, in
  step order (pickled once, the same bytes to each), or a :class:`Failed` naming its error.

The sampler runs :class:`gigrl.training.overlap.Sampler`, the schedule of the in-process thread,
so step ``s`` is sampled by exactly version ``max(0, s - 1 - sft_steps - k)``: a run is as
deterministic as a one-process run with the same k, and its metrics are the same (a test).
Receiving threads read the weights off the sockets and put each version on the sampler's devices
while the sampler decodes, so new weights never stop the sampler; it waits only when the version
a step needs has not arrived yet (``time/sampler_idle_s``: the staleness bound at work).

The sampler itself may run on several processes (a JAX cluster of its own): its process 0 listens
and the others connect to it too; process 0 forwards them each version (:class:`Version`) and a
stop, every process rolls out its share of each step's rows, they agree before each step whether
to go on, GiGPO's anchor ids are grouped there (:func:`_sample`), and process 0 alone sends the
rollouts (:func:`serve`).

The query pool lives in the sampler, which starts from the trainer's pool state (its
checkpoint's, on a resume). Each rollout carries the pool's state after it, which the trainer
checkpoints with the step it trains, as in one process. Faults: when the sampler dies, the
trainer processes agree (one all-reduce of a flag) that step ``s``'s rollout did not reach all
of them, checkpoint the last step they trained and stop with an error naming the address; when
a trainer process dies, the sampler stops. Rerunning both resumes from the trainer's last
checkpoint, the rollouts that were in flight sampled again (none trained twice, none lost).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import queue
import threading
import time
from multiprocessing import connection
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from etils import epath

from gigrl import distributed
from gigrl import advantages as adv_lib
from gigrl import search as search_lib
from gigrl.advantages import inputs as adv_inputs
from gigrl.config_utils import ConfigError, UserError, host_port
from gigrl.models import lora as lora_lib
from gigrl.training import build
from gigrl.training import evaluate as evaluate_lib
from gigrl.training import overlap
from gigrl.training import state as state_lib
from gigrl.training import warmup

CONNECT_TIMEOUT_S = 1800.0    # how long either side waits for the other to connect
ENV_KEY = "GIGRL_SAMPLER_KEY"
STOP_WAIT_S = 60.0            # after one trainer process's stop, how long the others may take


class SamplerError(UserError):
  """The sampler process and the trainer lost each other (one line, ``gigrl-train`` exit 2)."""


@dataclasses.dataclass
class Hello:
  """First on each connection to the sampler: which trainer process it is (``role``
  "trainer"), or which other process of a sampler on several processes ("sampler")."""
  process_index: int
  process_count: int
  role: str = "trainer"
  shards: dict | None = None     # a sampler process: its :func:`own_shards`


@dataclasses.dataclass
class Version:
  """Sampler process 0 -> each other sampler process: a version's leaves, the shards that
  process holds of each (:func:`shards_for`; with ``model.lora`` after the start, the adapters
  only)."""
  version: int
  leaves: dict


@dataclasses.dataclass
class Start:
  """Trainer process 0 -> sampler when RL starts: what the sampler's schedule and pool start from.

  Attributes:
    first_rl_step, last_step, sft_steps, max_staleness: :class:`overlap.Sampler`'s arguments.
    version: the version (RL updates so far) of the params RL starts from (sent next, as
      :class:`Params`); pool_state: the query pool's :meth:`~gigrl.data.pool.QueryPool.state_dict`.
  """
  first_rl_step: int
  last_step: int
  sft_steps: int
  max_staleness: int
  version: int
  pool_state: dict


@dataclasses.dataclass
class Params:
  """Trainer process -> sampler: its shards of the params of ``version`` (RL updates so far).

  ``pieces``: ``(leaf index in jax.tree.leaves order, index: tuple of slices into the leaf,
  host array)``, one per shard this process holds with replica id 0, so that over all trainer
  processes each element of each leaf comes once. ``leaves``: the leaf indices the pieces cover,
  None = all (the start params, or a full fine-tune); with ``model.lora`` an update's version
  carries the adapters only, the frozen base being the start's.
  """
  version: int
  pieces: list
  leaves: list | None = None


@dataclasses.dataclass
class Failed:
  """The sampler's error, in words (sampler -> trainer), or a trainer process's that exits with
  an error (trainer -> sampler, in place of the clean stop ``None``)."""
  message: str

  @classmethod
  def of(cls, error: BaseException) -> "Failed":
    """``error`` as ``"<type>: <message>"``."""
    return cls(f"{type(error).__name__}: {error}")


def _authkey() -> bytes:
  return os.environ.get(ENV_KEY, "gigrl").encode()


def _pieces(arrays: dict[int, jax.Array]) -> list:
  """This process's :class:`Params` pieces of ``arrays`` (``{leaf index: array}``): each
  addressable shard with replica id 0, read to the host (no collective)."""
  return [(i, shard.index, np.asarray(shard.data)) for i, x in arrays.items()
          for shard in x.addressable_shards if shard.replica_id == 0]


def assemble(pieces: Sequence[tuple[int, tuple, np.ndarray]], like: Sequence[Any],
             leaves: Sequence[int] | None = None) -> dict[int, np.ndarray]:
  """Host leaves from the :class:`Params` pieces of every trainer process.

  Args:
    pieces: all processes' pieces of one version; like: leaves with the full shapes and dtypes;
      leaves: the leaf indices the pieces cover (None = all of ``like``).
  Returns:
    ``{leaf index: numpy array}`` for those leaves.
  Raises:
    RuntimeError: a leaf's pieces do not cover it exactly (a piece missing or sent twice).
  """
  idx = range(len(like)) if leaves is None else leaves
  out = {i: np.empty(like[i].shape, like[i].dtype) for i in idx}
  filled = dict.fromkeys(out, 0)
  for i, index, data in pieces:
    out[i][index] = data
    filled[i] += data.size
  bad = [i for i, x in out.items() if filled[i] != x.size]
  if bad:
    raise RuntimeError(f"the trainer's params pieces cover leaves {bad} "
                       f"{[filled[i] for i in bad]} elements of {[out[i].size for i in bad]}")
  return out


# ------------------------------------------------------------------------------- the trainer
def for_trainer(t, step: int, log: Callable[[str], None]):
  """The sampler of trainer ``t``'s RL steps from ``step`` on: a :class:`RemoteSampler` with
  ``train.sampler_address`` (this trainer process's connection), else
  :func:`gigrl.training.overlap.for_trainer`.

  Raises:
    SamplerError: no sampler process listened within :data:`CONNECT_TIMEOUT_S`.
  """
  cfg = t.cfg
  address = str(cfg.train.get("sampler_address", ""))
  if not address:
    return overlap.for_trainer(t, step, log)
  sft = int(cfg.train.sft_steps)
  start = Start(first_rl_step=step, last_step=sft + int(cfg.train.num_steps), sft_steps=sft,
                max_staleness=int(cfg.train.max_staleness), version=step - 1 - sft,
                pool_state=t.pool.state_dict())
  trained = lora_lib.trained_leaf_indices(t.state.params, t.policy.lora.enabled)
  return RemoteSampler(address, start, t.state.params, log, trained=trained)


def _connect(address: str, timeout: float, log: Callable[[str], None], what: str):
  """A connection to the sampler process listening at ``address``, retrying until it listens
  (it does once its warm-up has compiled its rollout programs)."""
  deadline, said = time.monotonic() + timeout, time.monotonic()
  while True:
    try:
      return connection.Client(host_port("train.sampler_address", address), authkey=_authkey())
    except OSError as e:
      if time.monotonic() > deadline:
        raise SamplerError(f"no sampler process listened at train.sampler_address={address} "
                           f"within {timeout:.0f} s ({e}): start the same gigrl-train command "
                           "with --sampler") from None
      if time.monotonic() - said > 60:
        log(f"{what}: waiting for the sampler process at {address} (the same gigrl-train "
            "command with --sampler)")
        said = time.monotonic()
      time.sleep(0.5)


class RemoteSampler:
  """A trainer process's end of its connection to the sampler process, with
  :class:`overlap.Sampler`'s interface (:meth:`get`, :meth:`publish`, :meth:`paused`,
  :meth:`close`, ``k``).

  Args:
    address: ``host:port`` the sampler listens at; start: the :class:`Start` (sent by process
      0); params: the params RL starts from (version ``start.version``); log: a line logger.
    trained: :func:`lora.trained_leaf_indices`: the leaves sent after each update (None = all).
    timeout: seconds to wait for the sampler process to listen.
  """

  def __init__(self, address: str, start: Start, params, log: Callable[[str], None], *,
               trained: list[int] | None = None, timeout: float = CONNECT_TIMEOUT_S):
    self.address, self.k, self.trained = address, int(start.max_staleness), trained
    # the newest version a step samples with: the last step's
    self.last_version = max(0, start.last_step - 1 - start.sft_steps - self.k)
    self.conn = _connect(address, timeout, log, "RL")
    log(f"RL: connected to the sampler process at {address}")
    self.conn.send(Hello(jax.process_index(), jax.process_count()))
    if jax.process_index() == 0:
      self.conn.send(start)
    self.outbox: queue.Queue = queue.Queue()
    self.error: BaseException | None = None
    self.closed = False
    # the start version whole, read to the host now, once (no device copy of the whole
    # params: with LoRA none is made at all); then the sender thread takes over
    self.outbox.put((int(start.version), None, _pieces(dict(enumerate(jax.tree.leaves(params))))))
    self.sender = threading.Thread(target=self._send_loop, name="gigrl-weights", daemon=True)
    self.sender.start()

  def _send_loop(self) -> None:
    """Sends each published version (this process's shards of its leaves' device copies, read
    to the host here, off the trainer's thread), then ``None``."""
    try:
      while True:
        item = self.outbox.get()
        if item is None or isinstance(item, Failed):   # done, or the trainer failed
          self.conn.send(item)
          return
        version, leaves, arrays = item
        pieces = arrays if isinstance(arrays, list) else _pieces(arrays)
        self.conn.send(Params(version=version, pieces=pieces, leaves=leaves))
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def get(self, step: int) -> tuple[overlap.Rollout, float]:
    """RL step ``step``'s rollout from the sampler process, and the seconds waited for it.

    Every trainer process calls it for every step, and they agree (:func:`distributed.any_process`)
    on whether all of them got it, so all raise at the same step or none does.

    Raises:
      SamplerError: the sampler failed (its error named) or a connection was lost.
    """
    t0 = time.perf_counter()
    msg, error = None, None
    try:
      msg = self.conn.recv()
    except (EOFError, OSError):
      error = (f"the sampler process at train.sampler_address={self.address} closed the "
               f"connection before RL step {step}: rerun both commands to resume from the last "
               "checkpoint")
    if isinstance(msg, Failed):
      error = (f"the sampler process at train.sampler_address={self.address} failed: "
               f"{msg.message}")
    elif msg is not None and (not isinstance(msg, overlap.Rollout) or msg.step != step):
      error = (f"expected the rollout of RL step {step} from the sampler process at "
               f"train.sampler_address={self.address}, got {type(msg).__name__} "
               f"{getattr(msg, 'step', '')}")
    if distributed.any_process(error is not None):
      raise SamplerError(error or f"another trainer process lost the sampler process at "
                         f"train.sampler_address={self.address} before RL step {step}")
    return msg, time.perf_counter() - t0

  def publish(self, params, version: int) -> None:
    """Queues update ``version``'s ``trained`` leaves for the sampler (with LoRA the adapters
    alone; device copies now, :func:`state.copy_leaves`, since the next update donates the
    trainer's buffers; read to the host and sent by the sending thread). A failed send shows at
    the next :meth:`get` (the connection is gone)."""
    if int(version) > self.last_version or self.error is not None:   # no step samples with it
      return
    self.outbox.put((int(version), self.trained, state_lib.copy_leaves(params, self.trained)))

  def paused(self):
    """Nothing to hold: evaluations run on the trainer's devices and retriever."""
    return contextlib.nullcontext()

  def close(self, error: BaseException | None = None) -> None:
    """Tells the sampler process to stop, or with ``error`` (the exception this trainer process
    exits with) that it failed, and closes the connection (idempotent)."""
    if self.closed:
      return
    self.closed = True
    self.outbox.put(None if error is None else Failed.of(error))
    self.sender.join(timeout=60)
    self.conn.close()


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
    self.adv_cfg = adv_lib.AdvantageConfig.from_config(cfg.advantage)
    self.device_leaves: list | None = None    # the last params put, by leaf (:meth:`put`)

  def put(self, leaves: dict[int, Any]) -> Any:
    """Host leaves (:func:`assemble`'s, by leaf index) -> params on this process's devices, in
    the training layout (:func:`overlap.sample_step` turns them into the rollout's). A leaf is
    a whole array, or (a sampler process other than 0, :func:`own_shards`) the shards this
    process holds, ``{shard_key: array}``. A leaf not given is the last one put (with
    ``model.lora``: the frozen base, put once)."""
    ref = jax.tree.leaves(self.policy.params)
    idx = sorted(leaves)

    def shard(i, index):      # this process's shard ``index`` of leaf i
      x = leaves[i]
      return x[_shard_key(index, ref[i].shape)] if isinstance(x, dict) else x[index]

    # each process puts its own shards of each leaf (on several processes, only those)
    put = [jax.make_array_from_callback(ref[i].shape, ref[i].sharding, functools.partial(shard, i))
           for i in idx]
    if self.device_leaves is None:
      if idx != list(range(len(ref))):
        raise RuntimeError(f"the first params put covers leaves {idx}, not all {len(ref)}")
      self.device_leaves = [None] * len(ref)
    for i, x in zip(idx, put):
      self.device_leaves[i] = x
    return jax.tree.unflatten(jax.tree.structure(self.policy.params), self.device_leaves)


def _shard_key(index: tuple, shape: tuple) -> tuple:
  """A shard's index (a tuple of slices into a leaf of ``shape``) as (start, stop) pairs."""
  return tuple((sl.start or 0, dim if sl.stop is None else sl.stop)
               for sl, dim in zip(index, shape))


def own_shards(params: Any) -> dict[int, list[tuple]]:
  """The shards of each leaf (``jax.tree.leaves`` index -> :func:`_shard_key` list) that this
  process's devices hold: what a sampler process other than 0 asks process 0 to forward."""
  out = {}
  for i, x in enumerate(jax.tree.leaves(params)):
    keys = {_shard_key(index, x.shape)
            for index in x.sharding.addressable_devices_indices_map(x.shape).values()}
    out[i] = sorted(keys)
  return out


def shards_for(leaves: dict[int, np.ndarray], wanted: dict[int, list[tuple]]) -> dict:
  """``{leaf: {shard_key: host array}}``: the shards ``wanted`` (:func:`own_shards` of a
  process) of the host ``leaves``, so that each sampler process is sent what its devices hold,
  not every leaf whole."""
  return {i: {k: np.ascontiguousarray(x[tuple(slice(a, b) for a, b in k)]) for k in wanted[i]}
          for i, x in leaves.items()}


def _accept(address: str, peers: int, timeout: float, log: Callable[[str], None]
            ) -> tuple[list, list]:
  """Listens at ``address`` until every trainer process and the ``peers`` other processes of
  this sampler have connected: (the trainer's connections, the peers' (connection, its
  :func:`own_shards`)), each in process order.

  Raises:
    ConfigError: naming ``train.sampler_address`` when this host cannot listen there.
    SamplerError: not every process connected within ``timeout`` seconds.
  """
  try:
    listener = connection.Listener(host_port("train.sampler_address", address),
                                   authkey=_authkey())
  except OSError as e:
    raise ConfigError("train.sampler_address", address,
                      f"an address this host can listen at ({e})") from None
  log(f"sampler: listening at {address} for the trainer (the same gigrl-train command without "
      "--sampler)" + (f" and {peers} other sampler process(es)" if peers else ""))
  conns: dict[str, dict[int, Any]] = {"trainer": {}, "sampler": {}}
  count: list[int] = [1]

  def accept() -> None:
    while len(conns["trainer"]) < count[0] or len(conns["sampler"]) < peers:
      conn = listener.accept()
      hello = conn.recv()
      if hello.role == "trainer":
        count[0] = int(hello.process_count)
        conns["trainer"][int(hello.process_index)] = conn
      else:                             # with the shards to forward it
        conns["sampler"][int(hello.process_index)] = (conn, hello.shards)

  got: list = []
  thread = threading.Thread(target=lambda: got.append(_call(accept)), daemon=True)
  thread.start()
  thread.join(timeout)
  listener.close()
  if thread.is_alive() or got[0] is not None:
    why = f" ({got[0]})" if got and got[0] is not None else ""
    raise SamplerError(f"{len(conns['trainer'])} of {count[0]} trainer processes and "
                       f"{len(conns['sampler'])} of {peers} other sampler processes connected "
                       f"to train.sampler_address={address} within {timeout:.0f} s{why}: start "
                       "the same gigrl-train command without --sampler")
  log(f"sampler: {count[0]} trainer process(es) connected")
  return ([conns["trainer"][i] for i in range(count[0])],
          [conns["sampler"][i] for i in sorted(conns["sampler"])])


def _call(fn: Callable[[], None]) -> BaseException | None:
  try:
    fn()
    return None
  except BaseException as e:  # pylint: disable=broad-except
    return e


class _Versions:
  """The sampler's receiving side: each trainer process's :class:`Params` pieces, a version
  published to ``publish(leaves, version)`` once every process's have arrived."""

  def __init__(self, count: int, like: Sequence[Any], publish: Callable[[dict, int], None],
               log: Callable[[str], None]):
    self.count, self.like, self.publish, self.log = count, like, publish, log
    self.pieces: dict[int, list] = {}
    self.arrived: dict[int, int] = {}
    self.lock = threading.Lock()

  def add(self, msg: Params) -> None:
    with self.lock:
      v, leaves = int(msg.version), msg.leaves
      self.pieces.setdefault(v, []).extend(msg.pieces)
      self.arrived[v] = self.arrived.get(v, 0) + 1
      if self.arrived[v] < self.count:
        return
      pieces = self.pieces.pop(v)
      del self.arrived[v]
    got = assemble(pieces, self.like, leaves)
    _log_received(self.log, v, got, self.like)
    self.publish(got, v)


def _log_received(log: Callable[[str], None], version: int, got: dict, like: Sequence[Any]):
  log(f"sampler: version {version} received ({len(got)} of {len(like)} leaves, "
      f"{sum(x.nbytes for x in got.values()) / 2**20:.1f} MiB)")


def _given(anchor_ids, group_fn, rows):  # pylint: disable=unused-argument
  """A rollout's ``owned`` once its anchor ids were grouped by the sampler's processes."""
  return anchor_ids


def _sample(side: SamplerSide, step: int, params, version: int,
            log: Callable[[str], None]) -> overlap.Rollout:
  """:func:`overlap.sample_step`; on several processes GiGPO's anchor ids are grouped here, by
  the sampler's processes that hold the rows' strings (a collective of theirs, which the
  trainer could not call), and travel with the rollout."""
  r = overlap.sample_step(side, step, params, version, log)
  if jax.process_count() > 1:
    group_fn = adv_inputs.anchor_group_fn(side.adv_cfg, r.rows, side.settings.max_turns + 1)
    r.owned = functools.partial(_given, None if group_fn is None else r.owned(group_fn, r.rows))
  return r


def _all_go(go: bool) -> bool:
  """Whether every process of the sampler goes on (one all-reduce of a flag)."""
  return not distributed.any_process(not go)


def serve(cfg: ml_collections.ConfigDict, workdir: str | epath.PathLike,
          log: Callable[[str], None], timeout: float = CONNECT_TIMEOUT_S) -> int:
  """``gigrl-train --sampler``: builds the sampler, compiles its rollout programs, listens at
  ``train.sampler_address`` for the trainer's processes and samples the RL steps they start,
  until they stop it or its last step is sent.

  On several processes (``jax.distributed``, a cluster of its own, not the trainer's) the
  sampler's process 0 listens, and the others connect to it too: it forwards them each version
  it assembles (:class:`Version`: to each, the shards its devices hold) and a stop; every process runs the same
  schedule on its share of the rows, they agree before each step whether to go on (so all
  sample it or none does), and process 0 alone sends the rollouts.

  Returns:
    the number of rollouts sent (process 0), or sampled (the others).
  Raises:
    ConfigError: no ``train.sampler_address`` (or ``train.max_staleness = 0``: the config's own
      check). SamplerError: the trainer (or a sampler process) did not connect within
      ``timeout`` seconds, or a connection was lost.
  """
  address = str(cfg.train.get("sampler_address", ""))
  if not address:
    raise ConfigError("train.sampler_address", address, "host:port for the sampler process to "
                      "listen at (the trainer connects there)")
  side = SamplerSide(cfg, epath.Path(workdir) / "sampler", log)
  warmup.warm_up_sampler(side, side.eval_questions, log)
  if jax.process_index():
    return _serve_peer(side, address, timeout, log)
  conns, peers = _accept(address, jax.process_count() - 1, timeout, log)
  send_lock = threading.Lock()

  def forward(msg) -> None:    # to the other sampler processes, in order
    with send_lock:
      for i, (c, shards) in enumerate(peers, 1):
        try:     # a version: the shards that process holds
          c.send(Version(msg.version, shards_for(msg.leaves, shards))
                 if isinstance(msg, Version) else msg)
        except OSError:
          distributed.mark_peer_lost()
          raise SamplerError(f"sampler process {i} closed its connection to sampler process 0 "
                             f"at train.sampler_address={address}: rerun the trainer and every "
                             "sampler process to resume from the trainer's last checkpoint"
                             ) from None

  sent = 0
  try:
    try:
      start = conns[0].recv()
      first = [c.recv() for c in conns]       # every process's shards of the start params
    except (EOFError, OSError):
      raise SamplerError(f"the trainer closed its connection to train.sampler_address={address} "
                         "before RL started") from None
    like = jax.tree.leaves(side.policy.params)
    params = assemble([p for msg in first for p in msg.pieces], like)
    _log_received(log, start.version, params, like)
    forward(start)
    forward(Version(start.version, params))
    sampler = _start_sampler(side, start, params, log)

    def publish(got: dict, v: int) -> None:
      forward(Version(v, got))
      sampler.publish(got, v)

    versions = _Versions(len(conns), like, publish, log)
    errors: list[BaseException] = []

    def stop() -> None:       # a trainer process is done (or gone): stop after the current step
      sampler.stop()
      with contextlib.suppress(Exception):
        forward(None)

    def receive(conn, i: int) -> None:   # the weights, put on the devices as they come
      error = _read_trainer(conn, i, versions.add, address)
      if error is not None:
        errors.append(error)
      stop()

    receivers = [threading.Thread(target=receive, args=(c, i), name=f"gigrl-weights-{i}",
                                  daemon=True) for i, c in enumerate(conns)]
    for th in receivers:
      th.start()
    failed = True
    try:
      for step in range(start.first_rl_step, start.last_step + 1):
        try:
          r, _ = _get(sampler, step, address)
        except overlap.Stopped:
          _raise_if_any_lost(receivers, errors)
          break
        data = pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)     # once, for every process
        for i, c in enumerate(conns):
          try:
            c.send_bytes(data)
          except OSError:
            raise SamplerError(
                f"trainer process {i} closed its connection to train.sampler_address={address} "
                f"before RL step {step}: rerun both commands to resume from the trainer's last "
                "checkpoint") from None
        sent += 1
        _log_sampled(log, step, r)
      failed = False
    except BaseException as e:
      for c in conns:
        with contextlib.suppress(Exception):
          c.send(Failed.of(e))
      raise
    finally:
      sampler.close()
      # until every trainer process says stop: closing first (with its weights unread) would
      # reset the connection and drop the rollouts it has not read yet
      for th in receivers:
        th.join(None if not failed else 60)
      with contextlib.suppress(Exception):
        forward(None)
    # Every step was sent, but a trainer process went without stopping the sampler (killed
    # before it trained the last rollouts): the run is not finished, so not exit 0.
    if errors:
      raise errors[0] from None
  finally:
    for c in conns + [c for c, _ in peers]:
      c.close()
  return sent


def _read_trainer(conn, i: int, add: Callable[[Any], None], address: str) -> BaseException | None:
  """Reads trainer process ``i``'s messages off ``conn`` into ``add`` until it stops. Returns
  None after its clean stop (``None``), else the error to exit with: a :class:`SamplerError`
  when the trainer process failed (its :class:`Failed`) or its connection closed without a stop
  (killed, or lost), or whatever ``add`` raised (the sampling loop tells the trainer)."""
  rerun = "rerun both commands to resume from the trainer's last checkpoint"
  try:
    while (msg := conn.recv()) is not None:
      if isinstance(msg, Failed):       # the trainer process is exiting with an error
        first = msg.message.strip().splitlines()[0] if msg.message.strip() else "no message"
        return SamplerError(f"trainer process {i} of train.sampler_address={address} failed "
                            f"({first}): {rerun}")
      add(msg)
  except (EOFError, OSError):         # gone without saying stop: killed, or lost
    return SamplerError(f"trainer process {i} closed its connection to "
                        f"train.sampler_address={address} without stopping the sampler: {rerun}")
  except BaseException as e:  # pylint: disable=broad-except
    return e
  return None


def _raise_if_any_lost(receivers: Sequence[threading.Thread], errors: list[BaseException],
                       wait: float = STOP_WAIT_S) -> None:
  """After a trainer process's stop: waits (up to ``wait`` seconds each) for every receiving
  thread to end, then raises the first error any of them recorded (a connection lost without a
  stop). One process's stop may come before another's loss is seen (when trainer process 1 is
  killed, process 0 stops cleanly while process 1's receiver may still be putting a version on
  the devices), and a sampler that stopped then would exit 0 for a run that lost a process."""
  for th in receivers:
    th.join(wait)
  if errors:
    raise errors[0] from None


def _get(sampler: overlap.Sampler, step: int, address: str):
  """``sampler.get(step)`` on any sampler process. When it fails because another process is gone
  (:func:`distributed.lost_process`, e.g. gloo's "Connection reset by peer" when another sampler
  process was killed) it raises a :class:`SamplerError` instead (one line, exit 2) that says to
  rerun, the cluster marked as having lost a process (the exit skips jax's shutdown barrier,
  which would wait 100 s for it and then abort the survivor). ``overlap.Stopped`` and any other
  error pass through unchanged."""
  try:
    return sampler.get(step)
  except overlap.Stopped:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if distributed.lost_process(e):   # a failed collective: another process is gone
      raise SamplerError(
          f"sampler {distributed.lost_process_message(e)}: rerun the trainer and every sampler "
          f"process (train.sampler_address={address}) to resume from the trainer's last "
          "checkpoint") from None
    raise


def _start_sampler(side: SamplerSide, start: Start, params: dict,
                   log: Callable[[str], None]) -> overlap.Sampler:
  """The :class:`overlap.Sampler` schedule of ``start``, from host leaves ``params``."""
  side.pool.load_state_dict(start.pool_state)
  sampler = overlap.Sampler(
      lambda s, p, v: _sample(side, s, p, v, log),
      max_staleness=start.max_staleness, first_rl_step=start.first_rl_step,
      last_step=start.last_step, sft_steps=start.sft_steps, params=params,
      version=start.version, copy=side.put,
      agree=_all_go if jax.process_count() > 1 else None)
  log(f"sampler: RL steps {start.first_rl_step}-{start.last_step} from version "
      f"{start.version}, k = {start.max_staleness}"
      + (f", on {jax.process_count()} processes" if jax.process_count() > 1 else ""))
  return sampler


def _log_sampled(log: Callable[[str], None], step: int, r: overlap.Rollout) -> None:
  log(f"sampler: step {step} sampled by version {r.version} in {r.t_roll:.1f} s "
      f"(waited {r.idle_s:.1f} s for it)")


def _serve_peer(side: SamplerSide, address: str, timeout: float,
                log: Callable[[str], None]) -> int:
  """A sampler process other than 0: connects to process 0 at ``address``, takes the start and
  each version from it, and samples its share of every step's rows until the last step or a
  stop. Returns the steps sampled."""
  conn = _connect(address, timeout, log, "sampler")
  me = jax.process_index()
  conn.send(Hello(me, jax.process_count(), role="sampler", shards=own_shards(side.policy.params)))
  lost = (f"sampler process 0 at train.sampler_address={address} closed the connection of "
          f"sampler process {me}")
  try:
    try:
      start, first = conn.recv(), conn.recv()
    except (EOFError, OSError):
      distributed.mark_peer_lost()
      raise SamplerError(lost + " before RL started") from None
    if start is None:
      return 0
    sampler = _start_sampler(side, start, first.leaves, log)
    errors: list[BaseException] = []

    def receive() -> None:
      try:
        while (msg := conn.recv()) is not None:
          sampler.publish(msg.leaves, msg.version)
      except (EOFError, OSError):
        distributed.mark_peer_lost()
        errors.append(SamplerError(lost))
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)
      sampler.stop()

    receiver = threading.Thread(target=receive, name="gigrl-weights", daemon=True)
    receiver.start()
    done = 0
    try:
      for step in range(start.first_rl_step, start.last_step + 1):
        try:
          _get(sampler, step, address)
        except overlap.Stopped:
          if errors:
            raise errors[0] from None
          break
        done += 1
    finally:
      sampler.close()
    receiver.join(60)
    return done
  finally:
    conn.close()
