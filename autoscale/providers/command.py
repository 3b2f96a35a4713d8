"""User-supplied executables as a provider: any cloud CLI, ``docker compose`` or ``kubectl`` behind JSON.

The executable is run as ``ARGV... ACTION`` with one JSON object on stdin and answers one JSON object on
stdout (exit status 0), so a shell script can wrap any tool. Every request carries ``term``, the lease
term of the replica that sends it (a fencing token: it only grows, so an executable that remembers the
highest term it has seen can refuse a replica that lost the lease and does not know it yet):

- ``provision``: stdin ``{"term", "request_id", "offer": {name, island, gpu, price_per_hour, capacity,
  provisioning_s}}``; stdout ``{"id", "url", "island"?}`` once the engine is started;
- ``terminate``: stdin ``{"term", "id"}``; stdout ``{}``;
- ``list``: stdin ``{"term"}``; stdout ``{"engines": [{"id", "url", "offer"?, "island"?}, ...]}``.

Its output is untrusted: a non-zero exit, a timeout, more than ``MAX_OUTPUT_BYTES`` of output or
malformed JSON is a ProviderError with the end of its stderr, credentials redacted. The child gets a
minimal environment (``BASE_ENV``) plus the variables the configuration names (``command_env``), never
the router's whole environment (its API keys and mesh secret paths). Examples: autoscale/providers/examples/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProviderError, ProvisionedEngine

MAX_OUTPUT_BYTES = 1024 * 1024
STDERR_TAIL_BYTES = 500
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
"""What any executable needs to find its tools and write temporary files, and nothing that is a secret."""
CREDENTIAL = re.compile(r"(?i)(bearer\s+|(?:token|secret|password|passwd|api[_-]?key|authorization|credential)\w*"
                        r"[\"']?\s*[:=]\s*[\"']?)[^\s\"',;]+")


class CommandProvider(Provider):
    name = "command"

    def __init__(self, argv: Sequence[str], timeout_s: float = 600.0, env_names: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        if not argv:
            raise ValueError("autoscaler.command: needs the executable to run")
        self.argv = list(argv)
        self.timeout_s = timeout_s
        source = os.environ if environ is None else environ
        self.env = {name: source[name] for name in (*BASE_ENV, *env_names) if name in source}
        self._secrets = sorted({source[n] for n in env_names if len(source.get(n, "")) >= 4}, key=len, reverse=True)

    async def _provision(self, request_id: str, offer: Offer, term: int) -> ProvisionedEngine:
        answer = await self._run("provision", {"term": term, "request_id": request_id,
                                               "offer": dataclasses.asdict(offer)},
                                 max(self.timeout_s, 2 * offer.provisioning_s))
        engine = ProvisionedEngine.from_json(answer)
        return dataclasses.replace(engine, offer=engine.offer or offer.name,
                                   island=engine.island or offer.island or None)

    async def terminate(self, engine_id: str, term: int) -> None:
        await self._run("terminate", {"term": term, "id": engine_id}, self.timeout_s)

    async def list(self, term: int) -> list[ProvisionedEngine]:
        answer = await self._run("list", {"term": term}, self.timeout_s)
        engines = answer.get("engines")
        if not isinstance(engines, list):
            raise ProviderError("list: expected {\"engines\": [...]}")
        return [ProvisionedEngine.from_json(e) for e in engines]

    def redact(self, text: str) -> str:
        """``text`` without the values of the variables passed on, nor anything shaped like a credential."""
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return CREDENTIAL.sub(r"\1[redacted]", text)

    async def _run(self, action: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        command = [*self.argv, action]
        try:
            with trio.fail_after(timeout_s):
                returncode, stdout, stderr = await self._exchange(command, json.dumps(payload).encode(), action)
        except trio.TooSlowError:
            raise ProviderError(f"{action}: {command[0]} did not answer within {timeout_s:.0f} s") from None
        except OSError as exc:
            raise ProviderError(f"{action}: cannot run {command[0]}: {exc}") from None
        tail = self.redact(stderr.decode(errors="replace")[-STDERR_TAIL_BYTES:].strip())
        if returncode != 0:
            raise ProviderError(f"{action}: {command[0]} exited with {returncode}: {tail}")
        try:
            answer = json.loads(stdout or b"{}")
        except (ValueError, RecursionError):
            shown = self.redact(repr(stdout[:200]))
            raise ProviderError(f"{action}: output is not JSON (or nested too deep): {shown}") from None
        if not isinstance(answer, dict):
            raise ProviderError(f"{action}: expected a JSON object, got {type(answer).__name__}")
        return answer

    async def _exchange(self, command: list[str], stdin: bytes, action: str) -> tuple[int, bytes, bytes]:
        """Run the child, feeding stdin and reading both outputs as they come: stdout up to the cap (the
        child is killed past it, so 200 MB of output never sits in the router's memory), stderr's tail."""
        process = await trio.lowlevel.open_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, env=self.env)
        stdout, stderr = bytearray(), bytearray()
        too_long = False
        try:
            async def feed() -> None:
                assert process.stdin is not None
                # a child that does not read its input: its answer says what it thinks of that
                async with process.stdin:
                    with contextlib.suppress(trio.BrokenResourceError):
                        await process.stdin.send_all(stdin)

            async def read_stderr() -> None:
                assert process.stderr is not None
                while chunk := await process.stderr.receive_some(65536):
                    stderr.extend(chunk)
                    del stderr[:-STDERR_TAIL_BYTES * 4]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(feed)
                nursery.start_soon(read_stderr)
                assert process.stdout is not None
                while chunk := await process.stdout.receive_some(65536):
                    stdout.extend(chunk)
                    if len(stdout) > MAX_OUTPUT_BYTES:
                        too_long = True
                        process.kill()
                        nursery.cancel_scope.cancel()
                        break
            returncode = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
        if too_long:
            raise ProviderError(f"{action}: output larger than {MAX_OUTPUT_BYTES} bytes")
        return returncode, bytes(stdout), bytes(stderr)
