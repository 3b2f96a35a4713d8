"""Who may send what, and whether now: API keys -> tenant, cache isolation, rate limits, priority shedding.

The decisions live in gateway/security and gateway/admission (sans-IO); this module calls them in order
for one request and, in a mesh, exchanges rate-limit counts with the other replicas so a tenant's limit
holds cluster-wide.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import trio

from gateway.admission.client_buckets import ClientBuckets
from gateway.admission.decision import Reject
from gateway.admission.priority import PRIORITY_HEADER, admit, resolve_priority
from gateway.admission.ratelimit import RateLimiter
from gateway.config import RouterConfig
from gateway.engines import EngineState
from gateway.metrics import RouterMetrics
from gateway.request_body import ParsedRequest
from gateway.security.auth import Authenticator, Tenant
from gateway.security.isolation import apply_cache_policy

PUBLISH_INTERVAL_S = 0.3
BYTES_PER_TOKEN_ESTIMATE = 4


class Gatekeeper:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, replica_id: str) -> None:
        self.auth = Authenticator(config.auth, config.tenants)
        self.limiter = RateLimiter(replica_id, config.admission)
        self.debug_route_buckets = ClientBuckets(config.admission.debug_route_per_second,
                                                 config.admission.debug_route_burst)
        self.admission = config.admission
        self.metrics = metrics
        self.has_limits = any(t.requests_per_second or t.prompt_tokens_per_minute for t in config.tenants)

    def tenant(self, headers: Mapping[str, str]) -> Tenant:
        """The caller's tenant (401 in OpenAI's format when auth is on and the key is missing or wrong)."""
        return self.auth.authenticate(headers.get("authorization"))

    def admin_tenant(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant an admin's request is charged to; 401/403 for a caller who is not an admin."""
        return self.auth.admin_as_tenant(headers.get("authorization"))

    def admit_debug_route(self, tenant: Tenant, client_host: str) -> None:
        """429 when this client (tenant at address) calls /debug/route faster than its small bucket allows."""
        verdict = self.debug_route_buckets.admit(f"{tenant.name}@{client_host}", trio.current_time(), "/debug/route")
        if isinstance(verdict, Reject):
            self.metrics.admission_rejections.labels("debug_route_rate_limited", "normal").inc()
            raise verdict.error()

    def require_admin(self, headers: Mapping[str, str]) -> None:
        self.auth.require_admin(headers.get("authorization"))

    def sees_cache_state(self, headers: Mapping[str, str]) -> bool:
        """Whether routing details (overlaps, estimates, reasons) may go back to this caller: only an admin
        (everyone when auth is off, which binds loopback unless the operator trusts the network). They are
        derived from what the engines hold: a shared tenant's overlaps would tell it, block by block, what
        other tenants sent; even an isolated tenant's estimates and reasons count other tenants' KV
        pressure and queues, and two tenants given one explicit cache_salt share their blocks."""
        return self.auth.is_admin(headers.get("authorization"))

    def isolate(self, tenant: Tenant, parsed: ParsedRequest) -> ParsedRequest:
        """Apply the tenant's cache policy: an isolated tenant's salt goes into the body and the index key."""
        body, raw, salt = apply_cache_policy(tenant, parsed.body, parsed.raw)
        if raw is parsed.raw:
            return parsed
        return dataclasses.replace(parsed, body=body, raw=raw, cache_salt=salt)

    def priority(self, tenant: Tenant, headers: Mapping[str, str]) -> str:
        return resolve_priority(tenant, headers.get(PRIORITY_HEADER))

    def check_rate(self, tenant: Tenant, priority: str) -> None:
        """The tenant's rate limits, without charging, for before its body is read and parsed: a tenant far
        over its limit sending 8 MiB bodies is turned away before each costs the loop a parse. Raises the
        429 ``admit`` would."""
        verdict = self.limiter.check(tenant, time.time())
        if isinstance(verdict, Reject):
            self.metrics.admission_rejections.labels("rate_limited", priority).inc()
            raise verdict.error()

    def precheck(self, tenant: Tenant, priority: str, candidates: Sequence[EngineState]) -> None:
        """``admit`` without charging, for before tokenization: a request that would be refused anyway
        is refused before it takes tokenizer time from the other tenants. Raises the same 429s."""
        self._shed(priority, candidates)
        self.check_rate(tenant, priority)

    def admit(self, tenant: Tenant, priority: str, parsed: ParsedRequest, prompt_tokens: int,
              candidates: Sequence[EngineState]) -> None:
        """Raise a 429 (with Retry-After) when the tenant is over its limits or every engine is too busy for
        this priority. Shedding is checked first, so a shed request costs the tenant nothing."""
        self._shed(priority, candidates)
        tokens = prompt_tokens or len(parsed.raw) // BYTES_PER_TOKEN_ESTIMATE
        verdict = self.limiter.admit(tenant, time.time(), tokens)
        if isinstance(verdict, Reject):
            self.metrics.admission_rejections.labels("rate_limited", priority).inc()
            raise verdict.error()

    def _shed(self, priority: str, candidates: Sequence[EngineState]) -> None:
        depths = [e.in_flight + e.load.waiting for e in candidates if e.routable]
        verdict = admit(priority, depths, self.admission.queue_threshold, self.admission.queue_retry_after_s)
        if isinstance(verdict, Reject):
            self.metrics.admission_rejections.labels("overloaded", priority).inc()
            raise verdict.error()

    async def share_limits(self, mesh) -> None:
        """Publish this replica's windowed counts into the mesh and take in the others'.

        A replica the membership no longer lists (it left or was declared dead) is forgotten at once: left
        as a stale peer it would halve this replica's share of every budget until ``peer_forget_after_s``.
        """
        mesh.on_peer_limits(lambda replica, payload: self.limiter.merge_peer_counts(replica, payload, time.time()))
        while True:
            live = set(mesh.live_members())
            for replica in self.limiter.peer_ids():
                if replica not in live:
                    self.limiter.forget_peer(replica)
            mesh.set_limits(self.limiter.export(time.time()))
            await trio.sleep(PUBLISH_INTERVAL_S)
