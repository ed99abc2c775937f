"""The capture process's ledger: every unit an exchange becomes is, at any moment, either
settled (dropped and counted, or nothing to record) or carried by exactly one record on its way
to the spool, so that the proxy counts exactly what a killed capture process lost."""

from __future__ import annotations

import dataclasses

import orjson
from hypothesis import given, settings
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.ledger import Custody, Ledger
from trace_proxy.trajectories.record import Record
from trace_proxy.trajectories.sampler import Policy, Sampler
from trajectories.test_sampling_timing import KEEP, SEED, schedules


def other(path: str, body: dict[str, object], response: dict[str, object]) -> Exchange:
    """An exchange of a run that sends no metadata."""
    return Exchange(
        method="POST", path=path, query="",
        request_headers=CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"})),
        path_metadata=[], upstream="u", start=0.0, status=200,
        request_body=orjson.dumps(body), response_chunks=[orjson.dumps(response)],
    )  # fmt: skip


BATCHED = other(  # one exchange, two calls
    "/v1/completions",
    {"model": "m", "prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 2},
    {"choices": [{"index": i, "text": "x", "finish_reason": "stop"} for i in (0, 1)]},
)
TOKENIZE = other("/tokenize", {"prompt": "hi"}, {"tokens": [1]})  # nothing to record
FINISH = dataclasses.replace(  # SkyRL's end of a session: closes one, records nothing itself
    other("/finish_session", {}, {}), query="session_id=s1"
)


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_each_unit_is_settled_or_carried_by_one_record_whatever_the_timing(
    schedule: tuple[list[Exchange], list[int]],
) -> None:
    arrivals, actions = schedule
    arrivals = [BATCHED, TOKENIZE, FINISH, *arrivals]
    ledger = Ledger()
    out: list[Record] = []
    gate = SamplingGate(Sampler(SEED, Policy(max_samples=KEEP)), out.append, ledger=ledger)
    assembler = Assembler(out.append, project="p", experiment="e", idle_timeout=600, gate=gate,
                          defer_finishing=True, ledger=ledger)  # fmt: skip
    stage = CaptureStage(
        MetadataResolver([]), assembler, Metrics(), project="p", experiment="e",
        queue_size=10_000, idle_check_interval=60, ledger=ledger,
    )  # fmt: skip
    waiting = iter(arrivals)
    sent = 0  # exchanges given to the stage
    taken = 0  # units of the records written so far, as the spool writer takes them
    for action in [*actions, *[0] * len(arrivals)]:
        if action == 0:
            arrived = next(waiting, None)
            sent += arrived is not None
            if arrived is not None and stage.admit(arrived):
                stage.submit(arrived)
        elif action == 1:
            stage.process_waiting()
        elif assembler.pending:
            assembler.run_pending(until=0.0)  # one item
        taken += sum(ledger.take(out))  # what the writer would write now
        out.clear()
        assert sent + ledger.expanded - ledger.settled - taken >= 0  # what is still held
    while stage.process_waiting():
        pass
    assembler.run_pending()
    assembler.close_all()
    assembler.run_pending()
    taken += sum(ledger.take(out))
    assert taken + ledger.settled == len(arrivals) + ledger.expanded
    assert ledger.expanded == (2 - 1) + (0 - 1) + (0 - 1)  # batched: two; the others: none
    assert taken >= 2 + KEEP * 4 * 2 * 2  # the batch's calls; kept samples' rollouts' turns


def test_the_proxy_counts_as_lost_only_what_was_not_written() -> None:
    """A capture process was sent 10 exchanges; one made two calls, 2 were dropped by the
    sampler. Records announced at 5 (3 units) and 6 (2 units) were being written when it
    died; the spool was found to end at 6: record 5 was written, record 6 was not."""
    custody = Custody(sent=10)
    custody.update({"expanded": 1, "settled": 2})
    custody.spooling(3, [1, 1])  # written, as a later status said
    custody.written(5)
    custody.spooling(5, [3, 2])
    unsettled = custody.unsettled()
    assert unsettled.held == 10 + 1 - 2 - 2
    assert unsettled.lost(spool_end=6) == 7 - 3
    assert unsettled.lost(spool_end=None) == 7  # not known: at most
