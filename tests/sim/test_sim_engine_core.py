"""Scheduler + cache: prefix hits, salt isolation, decode blocks, report mode, preemption."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from index.vllm_hash import block_hashes
from sim.engine_core import EngineCore, SimRequest
from sim.kv_cache import BlockRemoved, BlockStored, KVCache
from sim.profiles import get_profile

VOCAB = list(range(10, 100))


def make_core(num_blocks=64, block_size=4, max_num_seqs=8):
    return EngineCore(KVCache(num_blocks, block_size), get_profile("a40-qwen1.5b"), max_num_seqs, VOCAB, "seed")


def req(rid, prompt, max_tokens=1, salt=None, full=False):
    return SimRequest(rid, list(prompt), max_tokens, "length", random.Random(rid), cache_salt=salt,
                      report_full=full)


def run_all(core, limit=1000):
    outputs, events = [], []
    for _ in range(limit):
        if not core.has_work():
            return outputs, events
        r = core.step()
        outputs += r.outputs
        events += r.events
    raise AssertionError("engine did not drain")


def stored(events):
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def test_second_identical_prompt_hits_all_but_the_last_block():
    core = make_core()
    prompt = list(range(1, 18))
    core.add(req("a", prompt))
    out1, ev1 = run_all(core)
    core.add(req("b", prompt))
    out2, ev2 = run_all(core)
    assert out1[-1].cached_tokens == 0
    assert out2[-1].cached_tokens == 16
    assert stored(ev1) == block_hashes(prompt, 4, seed="seed")
    assert stored(ev2) == []
    assert core.stats.prefix_hits == 16 and core.stats.prefix_queries == 34


def test_a_request_admitted_in_the_same_step_hits_the_blocks_an_earlier_one_is_computing():
    """vLLM caches the blocks a step will fill when it schedules the step (``allocate_slots``): the second of two
    identical prompts admitted together computes only its last token, and the blocks are announced once."""
    core = make_core()
    prompt = list(range(1, 18))
    core.add(req("a", prompt))
    core.add(req("b", prompt))
    step = core.step()
    assert {out.request_id: out.cached_tokens for out in step.outputs} == {"a": 0, "b": 16}
    assert stored(step.events) == block_hashes(prompt, 4, seed="seed")


def test_prompt_ending_on_block_boundary_recomputes_the_last_block():
    core = make_core()
    core.add(req("a", range(1, 17)))
    run_all(core)
    core.add(req("b", range(1, 17)))
    out, _ = run_all(core)
    assert out[-1].cached_tokens == 12


def test_cache_salt_isolates_tenants():
    core = make_core()
    prompt = list(range(1, 18))
    core.add(req("a", prompt, salt="t1"))
    _, ev = run_all(core)
    core.add(req("b", prompt, salt="t2"))
    out, _ = run_all(core)
    assert out[-1].cached_tokens == 0
    first = next(e for e in ev if isinstance(e, BlockStored))
    assert first.extra_keys[0] == ("t1",) and first.extra_keys[1] is None
    core.add(req("c", prompt, salt="t1"))
    out, _ = run_all(core)
    assert out[-1].cached_tokens == 16


def test_generated_tokens_fill_and_announce_decode_blocks():
    core = make_core()
    core.add(req("a", range(1, 7), max_tokens=7))
    out, ev = run_all(core)
    generated = [o.token_id for o in out]
    assert len(generated) == 7
    # 6 prompt + 6 computed generated tokens = 12 tokens = 3 full blocks (the last sample is never computed)
    all_tokens = list(range(1, 7)) + generated
    assert stored(ev) == block_hashes(all_tokens[:12], 4, seed="seed")
    toks = [t for e in ev if isinstance(e, BlockStored) for t in e.token_ids]
    assert toks == all_tokens[:12]


def test_report_mode_full_reannounces_reused_blocks_with_no_parent():
    core = make_core()
    prompt = list(range(1, 14))
    core.add(req("a", prompt))
    run_all(core)
    core.add(req("b", prompt, full=True))
    _, ev = run_all(core)
    [again] = [e for e in ev if isinstance(e, BlockStored)]
    assert again.parent_block_hash is None
    assert again.block_hashes == block_hashes(prompt, 4, seed="seed")[:3]


def test_out_of_blocks_preempts_the_newest_running_request():
    core = make_core(num_blocks=7, block_size=4)
    core.add(req("a", range(1, 9), max_tokens=12))
    core.add(req("b", range(21, 29), max_tokens=12))
    out, _ = run_all(core)
    assert core.stats.preemptions >= 1
    done = {o.request_id for o in out if o.finish_reason}
    assert done == {"a", "b"}
    assert core.cache.num_free == core.cache.usable_blocks


def test_abort_releases_blocks():
    core = make_core()
    core.add(req("a", range(1, 30), max_tokens=50))
    core.step()
    assert core.cache.num_free < core.cache.usable_blocks
    core.abort("a")
    assert core.cache.num_free == core.cache.usable_blocks and not core.has_work()


def test_reset_is_published_at_the_next_step():
    core = make_core()
    core.request_reset()
    r = core.step()
    assert [type(e).__name__ for e in r.events] == ["AllBlocksCleared"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
       st.integers(8, 40))
def test_every_request_finishes_and_events_replay_to_the_cache_state(reqs, num_blocks):
    core = make_core(num_blocks=num_blocks, block_size=4, max_num_seqs=4)
    prefixes = [list(range(100 * p, 100 * p + 60)) for p in range(4)]
    for i, (p, n, m) in enumerate(reqs):
        if n + m <= core.max_model_len:
            core.add(req(f"r{i}", prefixes[p][:n], max_tokens=m))
    out, ev = run_all(core)
    finished = [o for o in out if o.finish_reason]
    assert len(finished) == len({o.request_id for o in finished})
    assert core.cache.num_free == core.cache.usable_blocks
    live: dict[bytes, int] = {}
    for e in ev:
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                live[h] = live.get(h, 0) + 1
        elif isinstance(e, BlockRemoved):
            live[e.block_hashes[0]] -= 1
    assert {h for h, c in live.items() if c > 0} == {h for h in live if core.cache.is_cached(h)}
