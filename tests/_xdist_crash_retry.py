"""pytest-xdist's ``--dist loadfile`` scheduling, made safe for a worker that dies.

A worker process can die in native code: a ``SIGABRT`` killed a worker in 2 of 3 full runs on
2026-11-25, at a different test each time (once with its Python stack in an eager jax op), and
the test passes alone. pytest-xdist 3.8 (the newest release) then re-queues the dead worker's
whole file, completed tests included, and can wait forever (pytest-xdist #1323, #1327; fixed on its main branch after 3.8):
the CI job hung until its 90-minute limit. Its ``LoadScopeScheduling`` also cannot put a
crashed test back (``mark_test_pending`` raises), so pytest-rerunfailures cannot rerun it.

``CrashSafeLoadFile`` is ``LoadFileScheduling`` with these methods replaced:

* ``remove_node``: the dead worker's work goes back at the front of the queue, pending tests
  only; the test it died on is left out (reported failed by xdist, unless rerun below).
* ``mark_test_pending``: puts one test back (pytest-rerunfailures calls it for a crashed test,
  pytest.ini's ``--reruns 1 --only-rerun``: a crash is rerun once, an ordinary failure never).
* ``_reschedule``: a worker is never left holding a single test with more work queued (a worker
  runs a test only once it knows the next one, or is told to shut down).

``unfinished`` lists what never ran when the run stopped at ``--max-worker-restart``; this
module's ``pytest_sessionfinish`` then fails the session (xdist alone would exit 0 with a rerun
still queued). tests/conftest.py imports the two hooks.

The file-level grouping, and so each file's module fixtures built once per worker, is unchanged.
"""
from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFile(LoadFileScheduling):
  """``--dist loadfile`` whose dead workers' tests are re-queued (see the module docstring)."""

  def remove_node(self, node):
    workload = self.assigned_work.pop(node)
    pending = {scope: [n for n, done in unit.items() if not done]
               for scope, unit in workload.items()}
    pending = {scope: ids for scope, ids in pending.items() if ids}
    if not pending:
      return None
    crashitem = next(iter(pending.values()))[0]      # a worker runs its tests in order
    for scope, ids in reversed(list(pending.items())):
      self._queue_front(scope, [n for n in ids if n != crashitem])
    for other in self.assigned_work:
      self._reschedule(other)
    return crashitem

  def mark_test_pending(self, item):
    self._queue_front(self._split_scope(item), [item])
    for node in self.assigned_work:
      self._reschedule(node)

  def unfinished(self) -> list[str]:
    """Tests queued or assigned but never finished (the run stopped at --max-worker-restart)."""
    left = [n for unit in self.workqueue.values() for n, done in unit.items() if not done]
    return left + [n for work in self.assigned_work.values() for unit in work.values()
                   for n, done in unit.items() if not done]

  def _queue_front(self, scope, nodeids):
    if not nodeids:
      return
    unit = {n: False for n in nodeids}
    unit.update(self.workqueue.pop(scope, {}))
    self.workqueue[scope] = unit
    self.workqueue.move_to_end(scope, last=False)

  def _assign_work_unit(self, node):
    scope, unit = self.workqueue.popitem(last=False)
    assigned = self.assigned_work.setdefault(node, {})
    assigned.setdefault(scope, {}).update(unit)       # a re-queued test joins its file's unit
    collection = self.registered_collections[node]
    node.send_runtest_some([collection.index(n) for n, done in unit.items() if not done])

  def _reschedule(self, node):
    if node.shutting_down:
      return
    while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
      self._assign_work_unit(node)
    if not self.workqueue:
      node.shutdown()


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
  """``CrashSafeLoadFile`` for ``--dist loadfile``; any other --dist is xdist's own."""
  if config.getvalue("dist") != "loadfile":
    return None
  return CrashSafeLoadFile(config, log)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  """Fails the run when tests were left unrun because workers kept dying."""
  sched = getattr(session.config.pluginmanager.getplugin("dsession"), "sched", None)
  left = sched.unfinished() if isinstance(sched, CrashSafeLoadFile) else []
  if left:
    print(f"\n{__name__}: {len(left)} test(s) never finished (workers died): "
          + ", ".join(left[:10]))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
