"""The system-prompt overhead bench: its requests, its round order and what its table reports."""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import replace

import pytest

from bench.client import HttpClient
from bench.engine_stats import ENGINE_TTFT, delta, mean_engine_ttft, parse_counters
from bench.overhead import (
    ANSWER_TOKENS,
    SYSTEM_WORDS,
    Block,
    Case,
    answer_suffix,
    format_answer_cost,
    format_engine_view,
    format_revision_comparison,
    format_system_prompt,
    known_peer,
    rotated,
    system_prompt_requests,
    with_answer_lengths,
)
from bench.overhead_sweep import fleet_for_sweep, plot, split_cores, sweep_cases, verdicts
from bench.passthrough import passthrough_relay
from bench.revision import exported
from bench.runner import FleetSpec, sim_fleet
from bench.stats import RequestResult


def test_requests_share_the_system_prompt_and_nothing_else():
    first, second = system_prompt_requests(1, 2, 30), system_prompt_requests(2, 1, 30)
    systems = {c.system for c in [*first, *second]}
    assert len(systems) == 1 and len(next(iter(systems)).split()) == SYSTEM_WORDS
    users = [c.user_turns[0] for c in [*first, *second]]
    assert len(set(users)) == 3
    assert all(c.body("m", True)["stream"] for c in first)


def test_each_case_runs_once_per_answer_length_and_the_default_keeps_its_name():
    cases = with_answer_lengths([Case("c=1", 1, 30, 4), Case("c=16", 16, 30, 32)], [ANSWER_TOKENS, 256, 256])
    assert [(c.name, c.answer_tokens) for c in cases] == [
        ("c=1", ANSWER_TOKENS), ("c=1 a256", 256), ("c=16", ANSWER_TOKENS), ("c=16 a256", 256)]
    requests = system_prompt_requests(1, 2, 30, cases[1].answer_tokens)
    assert all(c.body("m", True)["max_tokens"] == 256 for c in requests)


def _answered(path: str, case: str, tokens: int, cpu_s: float) -> Block:
    block = Block(path, case, 0, [RequestResult(status=200, ttft=0.01, total=0.05, output_tokens=tokens)
                                  for _ in range(10)], 1.0)
    block.cpu_s = cpu_s
    return block


def test_cpu_per_relayed_token_is_the_cpu_difference_over_the_token_difference():
    cases = with_answer_lengths([Case("c=16", 16, 30, 32)], [ANSWER_TOKENS, 216])
    blocks = [_answered("engine", "c=16", 16, 0.0), _answered("engine", "c=16 a216", 216, 0.0),
              _answered("kvmesh", "c=16", 16, 0.050), _answered("kvmesh", "c=16 a216", 216, 0.250),
              _answered("smg", "c=16", 16, 0.020), _answered("smg", "c=16 a216", 216, 0.120)]
    line = format_answer_cost(blocks, cases)
    # kvmesh: (25 - 5 ms) / 200 tokens = 100 us; smg: (12 - 2 ms) / 200 = 50 us
    assert line == ("c=16     CPU per relayed answer token (16 -> 216 tokens): kvmesh 100.0 us (2.00x smg), "
                    "smg 50.0 us")
    assert format_answer_cost(blocks[:4], with_answer_lengths([Case("c=16", 16, 30, 32)], [ANSWER_TOKENS])) == ""


def test_each_path_leads_a_round_in_turn():
    paths = ["engine", "kvmesh", "smg"]
    assert [rotated(paths, r)[0] for r in range(4)] == ["engine", "kvmesh", "smg", "engine"]


def _block(path: str, rnd: int, ttft_ms: float, wall: float = 1.0, failed: int = 0, case: str = "c=1") -> Block:
    good = [RequestResult(status=200, ttft=ttft_ms / 1e3, total=0.03) for _ in range(10)]
    bad = [RequestResult(status=0, error="timeout") for _ in range(failed)]
    return Block(path, case, rnd, good + bad, wall)


def test_added_ttft_and_speed_are_taken_against_the_engine_of_the_same_round():
    blocks = [_block("engine", 0, 10), _block("kvmesh", 0, 11.5, wall=2.0),
              _block("engine", 1, 20), _block("kvmesh", 1, 21.0, wall=2.0, failed=1)]
    row = next(line for line in format_system_prompt(blocks).splitlines() if " kvmesh " in line)
    assert "+1.25ms" in row  # median of +1.5 and +1.0, not pooled p50s (20.75 - 15)
    assert " 16.25ms " in row  # the mean TTFT of all its answered requests
    assert " 0.50 " in row  # half the engine's req/s in both rounds
    assert row.split()[3] == "1"  # the failed request is counted


def test_router_cpu_is_per_answered_request_over_the_rounds_that_timed_it():
    blocks = [_block("engine", 0, 10), _block("kvmesh", 0, 11.0, failed=2),
              _block("engine", 1, 10), _block("kvmesh", 1, 11.0)]
    blocks[1].cpu_s, blocks[3].cpu_s = 0.010, 0.030  # 40 ms over 20 answered requests
    table = format_system_prompt(blocks).splitlines()
    assert next(line for line in table if " kvmesh " in line).endswith(" 2.00ms")
    assert next(line for line in table if " engine " in line).endswith(" 10.0")  # no CPU: the engine is no router


def test_the_pinned_router_gets_the_last_cpu_alone():
    pinning = split_cores({0, 1, 2, 3})
    assert pinning.router == {3} and pinning.rest == {0, 1, 2}
    with pytest.raises(SystemExit):
        split_cores({0})


def test_the_sweep_keeps_c1_and_sends_requests_in_proportion_to_the_streams():
    cases = sweep_cases([16, 256], short=True)
    assert [(c.name, c.concurrency, c.requests) for c in cases] == [("c=1", 1, 20), ("c=16", 16, 32),
                                                                    ("c=256", 256, 512)]
    assert sweep_cases([64], short=False)[1].requests == 256
    assert sweep_cases([64], short=True, c1_requests=4)[0].requests == 4
    assert [case.name for case in sweep_cases([1], short=True)] == ["c=1"]  # `--sweep 1`: c=1 alone, once


def test_the_swept_engine_admits_every_stream_of_the_widest_case():
    assert fleet_for_sweep(FleetSpec(max_num_seqs=64), [16, 256]).max_num_seqs == 256
    assert fleet_for_sweep(FleetSpec(max_num_seqs=512), [16, 256]).max_num_seqs == 512


def _sweep(kvmesh_ms: float, kvmesh_wall: float = 1.0) -> list[Block]:
    return [_block("engine", 0, 100, case="c=64"), _block("smg", 0, 105, case="c=64"),
            _block("kvmesh", 0, kvmesh_ms, wall=kvmesh_wall, case="c=64"),
            _block("engine", 0, 50, case="c=16"), _block("smg", 0, 50, case="c=16"),
            _block("kvmesh", 0, 500, case="c=16")]


def test_kvmesh_is_judged_against_smg_from_64_streams_up():
    assert verdicts(_sweep(114), [16, 64])[0].startswith("c=64   PASS")  # +14 against +5: within 10 ms
    assert verdicts(_sweep(116), [16, 64])[0].startswith("c=64   FAIL")
    assert verdicts(_sweep(110, kvmesh_wall=1.1), [16, 64])[0].startswith("c=64   FAIL")  # fewer req/s than smg
    assert len(verdicts(_sweep(110), [16, 64])) == 1  # c=16 is shown, not judged
    no_peer = [b for b in _sweep(110) if b.path != "smg"]
    assert verdicts(no_peer, [64])[0].startswith("no smg")


def test_the_sweep_plot_is_written(tmp_path):
    plot(_sweep(110), [16, 64], [16], tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_of_long_answers_alone_is_plotted_and_not_judged(tmp_path):
    """``--answer-tokens 256`` names every case ``c=N a256``: the plot draws those, and the targets, which are set
    at the default answer length, are not judged (this crashed on an empty median)."""
    long_answers = [replace(block, case=block.case + answer_suffix(256)) for block in _sweep(110)]
    plot(long_answers, [16, 64], [256], tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert verdicts(long_answers, [16, 64]) == [
        "no 16-token answers in this run: targets not judged (they are set at that length)"]
    assert answer_suffix(16) == "" and long_answers[0].case == "c=64 a256"


@pytest.mark.integration
async def test_the_passthrough_floor_relays_the_engines_stream_unchanged(tmp_path):
    """The floor row is only a floor if its relay does the same work: the engine's whole streamed answer."""
    client = HttpClient()
    spec = FleetSpec(engines=1, profile="fast", time_scale=1.0, num_blocks=1024)
    conversation = system_prompt_requests(1, 1, 30)[0]
    try:
        async with sim_fleet(client, spec, tmp_path) as engines, passthrough_relay(client, engines[0], tmp_path) as url:
            model = (await client.get_json(url + "/v1/models"))["data"][0]["id"]
            body = json.dumps({**conversation.body(model, True), "max_tokens": 5}).encode()
            direct = await client.request(engines[0] + "/v1/chat/completions", "POST", body)
            relayed = await client.request(url + "/v1/chat/completions", "POST", body)
    finally:
        await client.aclose()
    assert relayed.status == direct.status == 200
    events = [line for line in relayed.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == len(
        [line for line in direct.body.decode().splitlines() if line.startswith("data: ")])
    deltas = [c["delta"].get("content", "") for e in events[:-1] for c in json.loads(e[6:])["choices"]]
    assert sum(d != "" for d in deltas) == 5


def test_the_engine_view_shows_the_engines_own_ttft_and_cpu_per_path():
    """Every path shares one engine: the view sets what the engine did under each path side by side."""
    blocks = [_block("engine", 0, 10, wall=2.0), _block("kvmesh", 0, 12, wall=2.0),
              _block("engine", 1, 10, wall=2.0), _block("kvmesh", 1, 12, wall=2.0, failed=1)]
    for b, (cpu, own) in zip(blocks, [(1.0, 0.100), (1.2, 0.300), (1.0, 0.120), (1.4, None)], strict=True):
        b.engine_cpu_s, b.engine_ttft_s, b.engine_wait_s = cpu, own, cpu / 2
    blocks[1].wait_s = blocks[3].wait_s = 0.2
    rows = {line.split()[1]: line for line in format_engine_view(blocks).splitlines()[1:3]}
    # median TTFT; 2 s of CPU over 20 answered; half the wall on its core; a quarter waiting for one; no router
    assert rows["engine"].split()[2:] == ["110.0ms", "100.00ms", "50%", "25%", "-"]
    # a block without a TTFT is left out of that median only
    assert rows["kvmesh"].split()[2:] == ["300.0ms", "130.00ms", "65%", "32%", "10%"]


def test_the_engines_own_ttft_is_its_histograms_sum_over_count():
    text = ('# TYPE vllm:time_to_first_token_seconds histogram\n'
            'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} 3.0\n'
            'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 4.0\n'
            'vllm:time_to_first_token_seconds_count{engine="0"} 4.0\n'
            'vllm:time_to_first_token_seconds_sum{engine="0"} 0.8\n')
    before = parse_counters(text.replace(" 4.0", " 2.0").replace(" 0.8", " 0.2"), ENGINE_TTFT)
    assert mean_engine_ttft(delta(before, parse_counters(text, ENGINE_TTFT))) == pytest.approx(0.3)
    assert math.isnan(mean_engine_ttft(delta(before, before)))


def test_another_revisions_router_or_floor_is_a_peer_and_nothing_else_is():
    assert all(known_peer(p) for p in ("smg", "passthrough", "kvmesh@HEAD~1", "passthrough@5fe0ec5", "kvmesh@v1.2"))
    assert not any(known_peer(p) for p in ("kvmesh", "smg@HEAD", "kvmesh@", "kvmesh@-rf", "kvmesh@a b", "vllm"))


def test_a_revision_is_exported_once_per_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "gateway.py").write_text("OLD = 1\n")
    for argv in (["init", "-q"], ["add", "."], ["commit", "-qm", "one"], ["tag", "before"]):
        subprocess.run([*git, *argv], check=True)
    (repo / "gateway.py").write_text("NEW = 1\n")
    (repo / ".venv").symlink_to("/usr")  # a committed link out of the tree is left out, not a failed export
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    tree = exported("before", tmp_path / "logs", repo)
    assert (tree / "gateway.py").read_text() == "OLD = 1\n"
    assert exported("HEAD~1", tmp_path / "logs", repo) == tree  # the same commit by another name
    new = exported("HEAD", tmp_path / "logs", repo)
    assert (new / "gateway.py").read_text() == "NEW = 1\n"
    assert not (new / ".venv").is_symlink()


def test_cpu_and_ttft_are_compared_with_the_other_revision_round_by_round():
    blocks = [_block("kvmesh", 0, 11), _block("kvmesh@HEAD~1", 0, 10), _block("kvmesh", 1, 12),
              _block("kvmesh@HEAD~1", 1, 11.5), _block("passthrough", 0, 10)]
    for block, cpu in zip(blocks, (0.040, 0.050, 0.090, 0.100, 0.010), strict=True):
        block.cpu_s = cpu
    cpu_line, ttft_line = format_revision_comparison(blocks).splitlines()
    assert cpu_line == "c=1      CPU/req kvmesh / kvmesh@HEAD~1 per round: 0.80 0.90"
    assert ttft_line.startswith("c=1      TTFT p50 kvmesh - kvmesh@HEAD~1: median of 2 rounds +0.75 ms "
                                "(range +0.5..+1.0), all requests +")
    assert format_revision_comparison(blocks[-1:]) == ""
