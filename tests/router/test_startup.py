"""The router's answer for a model it cannot route to yet (`router.startup`), case by case:
503 + Retry-After naming the cause while the model's workers may still be starting, 404
once no known worker can be serving it."""

from __future__ import annotations

import pytest

from tandem.router.startup import StartupState
from tandem.router.workers import Worker

NOW = 1000.0


def state(synced: bool = True, started_at: float = NOW, seen: tuple[str, ...] = ()
          ) -> StartupState:
    return StartupState(window_s=300.0, started_at=started_at, synced=synced, seen=set(seen))


def w(model: str = "", ready: bool = False) -> Worker:
    return Worker(f"http://w-{model}-{ready}", model=model, ready=ready)


@pytest.mark.parametrize(("st", "workers", "model", "status", "says"), [
    (state(synced=False), [], "m", 503, "discovery has not reported"),
    (state(), [w()], "m", 503, "1 worker has not reported a model yet, so 'm'"),
    (state(), [w(), w()], "", 503, "2 workers have not reported a model yet;"),
    (state(started_at=NOW - 301), [w()], "m", 404, "model 'm' is not served here"),
    (state(started_at=NOW - 301, seen=("m",)), [w()], "m", 503, "may be served by one"),
    (state(), [w("m")], "m", 503, "model 'm': its worker is not ready yet"),
    (state(), [w("m"), w("m")], "m", 503, "none of its 2 workers is ready yet"),
    (state(), [w("m")], "", 503, "no model is ready yet: 1 worker is starting"),
    (state(), [w("m", ready=True)], "other", 404, "model 'other' is not served here"),
    (state(), [], "m", 404, "model 'm' is not served here"),
    (state(), [], "", 404, "no model is served here"),
])
def test_starting_or_not_served(st, workers, model, status, says) -> None:
    err = st.check(model, workers, NOW)
    assert err is not None and err.status == status, err
    assert says in err.message, err.message
    assert ("Retry-After" in (err.headers or {})) == (status == 503)


def test_a_routable_worker_routes_and_its_model_is_remembered_past_the_window() -> None:
    st = state(started_at=NOW - 301)
    served = [w("m", ready=True)]
    assert st.check("m", served, NOW) is None
    st.observe(served)  # as the router's discovery sync does before it removes a worker
    # its only worker was replaced by one that has not reported yet: requests wait, no 404
    err = st.check("m", [w()], NOW)
    assert err is not None and err.status == 503


def test_models_list_is_503_only_while_workers_may_be_starting() -> None:
    assert state().models_unavailable([w()], NOW).status == 503
    assert state(started_at=NOW - 301).models_unavailable([w()], NOW) is None
    assert state().models_unavailable([], NOW) is None  # nothing known: empty is the truth


def test_every_served_name_is_remembered_past_the_window() -> None:
    st = state(started_at=NOW - 301)
    worker = Worker("http://w-names", model="m", ready=True, aliases=frozenset({"org/m"}))
    assert st.check("org/m", [worker], NOW) is None
    st.observe([worker])
    err = st.check("org/m", [w()], NOW)  # replaced by a worker that has not reported yet
    assert err is not None and err.status == 503, err
