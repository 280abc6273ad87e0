"""The handlers' per-InferenceService writer lock and generation guard (`main._writer`), and
what an apply reports as changed (`reconcile.Applied`), on plain values."""

from __future__ import annotations

import threading
import time

import kopf

from tandem.operator.main import _writer
from tandem.operator.reconcile import Applied
from tandem.operator.render import Owner

OWNER = Owner("svc", "ml", "uid-1")


def test_a_timer_with_an_older_generation_than_the_change_handler_writes_nothing():
    memo = kopf.Memo()
    with _writer(memo, OWNER, 1) as current:
        assert current  # nothing taken up yet (e.g. just after a restart)
    with _writer(memo, OWNER, 2, newest=True) as current:
        assert current
    with _writer(memo, OWNER, 1) as current:
        assert not current  # a stale timer body: its spec was replaced
    with _writer(memo, OWNER, 2) as current:
        assert current
    other = Owner("svc", "ml", "uid-2")  # a recreated object with the same name
    with _writer(memo, other, 1) as current:
        assert current


def test_writers_of_one_inference_service_take_turns():
    memo, inside, overlaps = kopf.Memo(), [], []

    def write() -> None:
        with _writer(memo, OWNER, 1):
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(len(inside))
            time.sleep(0.02)
            inside.pop()

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []


def test_writers_of_different_inference_services_do_not_wait_for_each_other():
    memo, b_wrote = kopf.Memo(), threading.Event()

    def write_b() -> None:
        with _writer(memo, Owner("b", "ml", "uid-b"), 1):
            b_wrote.set()

    with _writer(memo, OWNER, 1):
        t = threading.Thread(target=write_b)
        t.start()
        assert b_wrote.wait(10)  # while OWNER's writer still holds its lock
    t.join()


def test_applied_changed_names_what_the_apply_wrote():
    done = Applied(before={"Service/a": "5", "Deployment/a": "7", "Role/old": "2"},
                   after={"Service/a": "5", "Deployment/a": "9", "ConfigMap/a": "11"},
                   removed=["Role/old"])
    assert done.changed == ["Deployment/a", "ConfigMap/a"]
