"""User-supplied executables as a provider: any cloud CLI, ``docker compose`` or ``kubectl`` behind JSON.

The executable is run as ``ARGV... ACTION`` with one JSON object on stdin and answers one JSON object on
stdout (exit status 0), so a shell script can wrap any tool:

- ``provision``: stdin ``{"request_id", "offer": {name, island, gpu, price_per_hour, capacity,
  provisioning_s}}``; stdout ``{"id", "url", "island"?}`` once the engine is started;
- ``terminate``: stdin ``{"id"}``; stdout ``{}``;
- ``list``: stdin ``{}``; stdout ``{"engines": [{"id", "url", "offer"?, "island"?}, ...]}``.

Its output is untrusted: a non-zero exit, a timeout or malformed JSON is a ProviderError with the end
of its stderr. Examples: autoscale/providers/examples/.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import trio

from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProviderError, ProvisionedEngine

MAX_OUTPUT_BYTES = 1024 * 1024


class CommandProvider(Provider):
    name = "command"

    def __init__(self, argv: Sequence[str], timeout_s: float = 600.0) -> None:
        super().__init__()
        if not argv:
            raise ValueError("autoscaler.command: needs the executable to run")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    async def _provision(self, request_id: str, offer: Offer) -> ProvisionedEngine:
        answer = await self._run("provision", {"request_id": request_id, "offer": dataclasses.asdict(offer)},
                                 max(self.timeout_s, 2 * offer.provisioning_s))
        engine = ProvisionedEngine.from_json(answer)
        return dataclasses.replace(engine, offer=engine.offer or offer.name,
                                   island=engine.island or offer.island or None)

    async def terminate(self, engine_id: str) -> None:
        await self._run("terminate", {"id": engine_id}, self.timeout_s)

    async def list(self) -> list[ProvisionedEngine]:
        answer = await self._run("list", {}, self.timeout_s)
        engines = answer.get("engines")
        if not isinstance(engines, list):
            raise ProviderError("list: expected {\"engines\": [...]}")
        return [ProvisionedEngine.from_json(e) for e in engines]

    async def _run(self, action: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        command = [*self.argv, action]
        try:
            with trio.fail_after(timeout_s):
                done = await trio.run_process(command, stdin=json.dumps(payload).encode(), capture_stdout=True,
                                              capture_stderr=True, check=False)
        except trio.TooSlowError:
            raise ProviderError(f"{action}: {command[0]} did not answer within {timeout_s:.0f} s") from None
        except OSError as exc:
            raise ProviderError(f"{action}: cannot run {command[0]}: {exc}") from None
        stderr = done.stderr.decode(errors="replace")[-500:].strip()
        if done.returncode != 0:
            raise ProviderError(f"{action}: {command[0]} exited with {done.returncode}: {stderr}")
        if len(done.stdout) > MAX_OUTPUT_BYTES:
            raise ProviderError(f"{action}: output larger than {MAX_OUTPUT_BYTES} bytes")
        try:
            answer = json.loads(done.stdout or b"{}")
        except ValueError:
            raise ProviderError(f"{action}: output is not JSON: {done.stdout[:200]!r}") from None
        if not isinstance(answer, dict):
            raise ProviderError(f"{action}: expected a JSON object, got {type(answer).__name__}")
        return answer


