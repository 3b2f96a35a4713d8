"""How a disaggregated request's engines are chosen (no sockets): the prefill work in flight on each prefill
engine, the prefill legs' measured times fed to the TTFT model, and each policy's order for both legs."""

from __future__ import annotations

import json

import pytest
import trio
from router_inprocess import MODEL, call, make_router

from gateway.config import EngineConfig
from gateway.disaggregation.config import PdConfig
from gateway.disaggregation.decider import Member, choose
from gateway.disaggregation.flow import Disaggregation, PdRoute
from gateway.disaggregation.prefill_load import PrefillLoad
from gateway.engines import EnginePool, EngineState
from gateway.metrics import RouterMetrics
from gateway.proxy import Attempt, Exchange, ProxyResult, Timeouts, UpstreamFailure, forward
from gateway.routing.learning import TTFTLearner
from gateway.routing.types import CandidateScore, Decision

PROMPT = 16_000
BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64}


def engine(engine_id: str, role: str) -> EngineState:
    url = f"http://{engine_id}"
    return EngineState(engine_id, EngineConfig(url=url, role=role, kv_protocol="handoff"), EnginePool(url))


def score(engine_id: str, cached: int = 0, depth: int = 0, queue_s: float = 0.0) -> CandidateScore:
    return CandidateScore(engine_id, cached, cached, float(cached), PROMPT - cached, 1.0, depth, queue_s,
                          (PROMPT - cached) / 20_000, 0.0, 0.0)


FLEET = [engine("p1", "prefill"), engine("p2", "prefill"), engine("d1", "decode"), engine("d2", "decode")]


class Model:
    """The router's TTFT learner as the flow sees it (what the route planner hands it)."""

    def __init__(self) -> None:
        self.learner = TTFTLearner()

    def estimate(self, engine_id: str, work: int, depth: int) -> float:
        return self.learner.params(engine_id, None).predict(work, depth, None)

    def observe(self, engine_id: str, work: int, depth: int, seconds: float) -> None:
        self.learner.observe(engine_id, work, depth, seconds)


def flow(model: Model | None = None) -> Disaggregation:
    model = model or Model()
    return Disaggregation(PdConfig(), RouterMetrics(), model.estimate, model.observe)


def route(pd: Disaggregation, table: list[CandidateScore], policy: str = "kv_aware", dry_run: bool = False
          ) -> PdRoute:
    decision = Decision([s.engine for s in table], table, "test", policy, PROMPT)
    by_id = {e.id: e for e in FLEET}
    found = pd.route(FLEET, [by_id[s.engine] for s in table], decision, PROMPT, BODY, dry_run)
    assert found is not None
    return found


def test_a_new_prefill_leg_waits_for_the_prompt_work_queued_ahead_of_it():
    load = PrefillLoad()
    first = load.price("p1", 12_000, queue_depth=0)
    load.begin(first)
    second = load.price("p1", 3_000, queue_depth=3)  # 1 of the 3 requests there is this router's leg
    assert (second.work, second.other_depth) == (15_000, 2)
    load.begin(second)
    load.end(first)
    assert (load.ahead("p1"), load.legs("p1")) == (3_000, 1)
    load.end(second)
    assert (load.ahead("p1"), load.legs("p1")) == (0, 0) and load.price("p2", 5, 0).work == 5


def test_the_prompts_holder_gets_the_prefill_leg_until_the_work_queued_there_outweighs_its_cache():
    pd = flow()
    table = [score("d1"), score("p1", cached=12_000), score("p2"), score("d2")]
    assert route(pd, table).choice.prefill == ["p1", "p2"]  # 4k tokens to prefill there, 16k on p2
    for _ in range(2):  # two more legs of 8k uncached tokens each are in flight on the holder
        pd.load.begin(pd.load.price("p1", 8_000, 1))
    assert route(pd, table).choice.prefill == ["p2", "p1"]  # 20k tokens of work on p1 against 16k on p2


async def answer(tokens_per_s: dict[str, float], fail: set[str] = frozenset()):
    """A fake proxy: a prefill leg's one-token answer comes after its engine's queued work at its speed."""
    work: dict[str, int] = {}

    async def forward(engines: list[EngineState], exchange: Exchange, max_attempts: int) -> ProxyResult:
        target = engines[0]
        if target.id in fail:
            raise UpstreamFailure(502, "bad gateway", attempts=[Attempt(target.id, "connect_error")])
        if json.loads(exchange.body)["max_tokens"] == 1:
            await trio.sleep(work[target.id] / tokens_per_s[target.id])
        await exchange.send({"type": "http.response.start", "status": 200, "headers": []})
        await exchange.send({"type": "http.response.body", "body": b'{"choices": []}'})
        return ProxyResult(target, 200, attempts=[Attempt(target.id, "ok")])

    return forward, work


def exchange() -> Exchange:
    async def drop(message: dict) -> None:
        pass

    return Exchange("POST", "/v1/chat/completions", b"{}", [], drop, Timeouts(), lambda e, a: [], True)


async def test_measured_prefill_legs_teach_the_model_which_prefill_engine_is_slow(autojump_clock):
    model = Model()
    pd = flow(model)
    forward, work = await answer({"p1": 5_000.0, "p2": 20_000.0})  # p1 prefills 4x slower than p2
    table = [score("d1"), score("p1", cached=6_000), score("p2")]
    before = route(pd, table)
    assert before.choice.prefill == ["p1", "p2"]  # by the priors alone, the holder is faster
    for i in range(40):
        held = {"p1": 6_000 if i % 2 else 0, "p2": 0 if i % 2 else 6_000}
        one = route(pd, [score("d1"), score("p1", cached=held["p1"]), score("p2", cached=held["p2"])])
        leg = one.legs[one.prefill[0].id]
        work[leg.engine] = leg.work
        await pd.serve(one, BODY, json.dumps(BODY).encode(), exchange(), forward, 1, True)
    assert model.learner.model("p1").observations > 5 and model.learner.model("p2").observations > 5
    assert model.estimate("p1", 10_000, 0) > 3 * model.estimate("p2", 10_000, 0)
    assert route(pd, table).choice.prefill == ["p2", "p1"]  # 16k tokens on p2 beat 10k on slow p1
    assert pd.load.ahead("p1") == pd.load.ahead("p2") == 0


async def test_a_failed_prefill_leg_gives_its_work_back_and_teaches_nothing():
    model = Model()
    pd = flow(model)
    forward, _ = await answer({}, fail={"p1", "p2"})
    one = route(pd, [score("d1"), score("p1"), score("p2")])
    await pd.serve(one, BODY, json.dumps(BODY).encode(), exchange(), forward, 1, True)
    assert pd.load.ahead("p1") == pd.load.legs("p1") == 0
    assert model.learner.model("p1").observations == 0


def test_round_robin_takes_each_roles_engines_in_turn():
    pd = flow()
    table = [score("d1"), score("p1"), score("p2"), score("d2")]  # the policy's rotation over all four
    route(pd, table, "round_robin", dry_run=True)  # /debug/route takes no turn
    pairs = [(r.choice.decode[0], r.choice.prefill[0]) for r in (route(pd, table, "round_robin") for _ in range(4))]
    assert pairs == [("d1", "p1"), ("d2", "p2"), ("d1", "p1"), ("d2", "p2")]


@pytest.mark.parametrize("order", ["cost", "rotate", "ranked"])
def test_every_order_pairs_the_first_decode_engine_with_prefill_engines_of_its_protocol(order):
    members = [Member("d1", "decode", "handoff", load_s=2.0), Member("d2", "decode", "opaque", load_s=0.5),
               Member("p1", "prefill", "handoff"), Member("p2", "prefill", "opaque"),
               Member("b", "both", "opaque", load_s=1.0)]
    for turn in range(3):
        choice = choose(members, PROMPT, 1, PdConfig(), order, turn)
        first = next(m for m in members if m.id == choice.decode[0])
        assert choice.prefill and all(
            m.protocol == first.protocol and m.id != first.id for m in members if m.id in choice.prefill)
    assert choose(members, PROMPT, 1, PdConfig(), "cost").decode[:2] == ["d2", "b"]  # decode legs go by load


async def test_failed_prefill_legs_keep_an_engine_that_also_decodes_from_prefilling_only():
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{listener.getsockname()[1]}"  # bound, never listening: connections are refused
    both = EngineState("b1", EngineConfig(url=dead, role="both", kv_protocol="handoff"), EnginePool(dead))
    only = EngineState("p1", EngineConfig(url=dead, role="prefill", kv_protocol="handoff"), EnginePool(dead))
    pd = flow()
    for prefill in (both, only):
        for _ in range(5):
            one = PdRoute(route(pd, [score("d1"), score("p1")]).choice, [only], [prefill], {})
            with pytest.raises(UpstreamFailure):  # the decode leg goes to the same dead address
                await pd.serve(one, BODY, json.dumps(BODY).encode(), exchange(), forward, 1, True)
    assert pd.prefill_breaker(both).state == "open" and both.health.breaker.available(trio.current_time())
    assert pd.prefill_breaker(only) is only.health.breaker and only.health.breaker.state == "open"
    listener.close()


async def test_the_router_teaches_the_ttft_model_with_the_prefill_leg_and_not_the_decode_leg():
    router = make_router()
    prefill, decode = router.engines.all()
    prefill.config.role, decode.config.role = "prefill", "decode"
    body = {"model": MODEL, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": " ".join(["word"] * 1500)}]}
    answer = await call(router, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert answer.status == 200 and "outcome=disaggregated" in answer.headers["x-kvmesh-pd"]
    learner = router.planner.policy.costs.learner
    assert learner.model(prefill.id).observations == 1 and learner.model(decode.id).observations == 0
    assert router.disaggregation.load.legs(prefill.id) == 0
