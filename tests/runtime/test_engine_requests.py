"""The request API a server drives (add_request / step / abort / generate_stream): it is the
machinery generate runs on, so streamed tokens equal generate's; a request that joins the
running batch mid-run changes no other request's greedy tokens; an aborted request's cache
blocks come back at the next step."""
from __future__ import annotations

import pytest

from runtime import InputError, SamplingParams
from tiny_engine import make_engine, prompts

GREEDY = SamplingParams(max_new_tokens=7, ignore_eos=True)


def _run(engine) -> dict[int, tuple[list[int], str]]:
    """step() to the end: request id -> (tokens, finish reason)."""
    got: dict[int, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _ = got.get(out.request_id, ([], None))
            got[out.request_id] = (tokens + out.token_ids, out.finish_reason)
    return got


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=6, temperature=0.8, top_k=9, seed=3,
                                                           ignore_eos=True)])
def test_stream_equals_generate(params):
    engine = make_engine(num_blocks=64)
    [p] = prompts([5])
    (want,) = engine.generate([p], params)
    outs = list(engine.generate_stream(p, params))
    assert [t for o in outs for t in o.token_ids] == want.token_ids
    assert all(len(o.token_ids) == 1 for o in outs)            # one chunk per step
    assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + [want.finish_reason]


def test_step_loop_equals_generate_and_joining_mid_run_changes_nothing():
    engine = make_engine(num_blocks=64)
    ps = prompts([3, 6, 4, 9], seed=1)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in ps]
    first = [engine.add_request(p, GREEDY) for p in ps[:2]]
    got = {}
    for _ in range(3):                                         # the first two run three steps alone
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    later = [engine.add_request(p, GREEDY) for p in ps[2:]]     # then two more join the batch
    for rid, (tokens, reason) in _run(engine).items():
        got.setdefault(rid, []).extend(tokens)
        assert reason == "length"
    assert [got[r] for r in first + later] == alone
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_abort_frees_blocks_at_the_next_step_and_spares_the_others():
    engine = make_engine(num_blocks=64)
    full = engine.tables.free_blocks
    a, b = prompts([9, 5], seed=2)
    (want_b,) = engine.generate([b], GREEDY)
    ra, rb = engine.add_request(a, GREEDY), engine.add_request(b, GREEDY)
    engine.step()
    engine.step()
    assert engine.tables.free_blocks < full
    assert engine.abort(ra) and not engine.abort(12345)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[ra].finish_reason == "abort" and outs[ra].token_ids == []
    assert ra not in engine.tables                                # its blocks came back
    rest = _run(engine)
    assert not engine.abort(ra)                                   # done: nothing to abort
    assert engine.tables.free_blocks == full
    assert engine.generate([b], GREEDY)[0].token_ids == want_b.token_ids
    assert rest[rb][1] == "length"


def test_abort_of_a_waiting_request():
    engine = make_engine(num_blocks=64)
    rid = engine.add_request(prompts([4])[0], GREEDY)
    engine.abort(rid)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(rid, "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_closing_a_stream_early_frees_its_blocks():
    engine = make_engine(num_blocks=64)
    stream = engine.generate_stream(prompts([6])[0], GREEDY)
    next(stream)
    assert engine.tables.free_blocks < engine.tables.allocator.num_blocks
    stream.close()
    assert not engine.has_unfinished_requests()
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_bad_requests_are_refused_before_they_are_queued():
    engine = make_engine(num_blocks=64, max_seq_len=32)
    with pytest.raises(InputError, match="out of range"):
        engine.add_request([1, 2, 1000], GREEDY)
    with pytest.raises(InputError, match="at most 32"):
        engine.generate_stream([1] * 40, GREEDY)                 # checked when called, not when iterated
    assert not engine.has_unfinished_requests()


def test_generate_refuses_to_run_beside_another_driver():
    engine = make_engine(num_blocks=64)
    rid = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(InputError, match="in flight"):
        engine.generate([[4, 5]], GREEDY)
    engine.abort(rid)
    engine.step()
    assert engine.generate([[4, 5]], GREEDY)[0].finish_reason == "length"
