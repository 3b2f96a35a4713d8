"""Router configuration: one TOML file, overridden by ``KVMESH_*`` variables, overridden by CLI flags.

Every key is validated at start-up; an error names the exact key (``engines[1].url``) so an operator
can fix a file without reading code.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from autoscale.config import AutoscaleConfig
from events.curve import CurveClient, check_z85_key
from events.discovery import check_topic
from gateway.admission.config import AdmissionConfig
from gateway.body_limits import LimitsConfig
from gateway.config_errors import ConfigError
from gateway.disaggregation.config import PdConfig
from gateway.disaggregation.roles import check_protocol, check_role
from gateway.engine_priority import EnginePriorityConfig
from gateway.media_config import MultimodalModelConfig
from gateway.security.config import AuthConfig, TenantConfig, validate_security
from gateway.tier_config import TierConfig
from tokenization.worker import default_workers

__all__ = ["AdmissionConfig", "AuthConfig", "AutoscaleConfig", "ConfigError", "EngineConfig", "LimitsConfig",
           "MeshConfig", "RouterConfig", "TenantConfig", "TracingConfig", "load_config", "validate_engine_url"]

POLICIES = ("kv_aware", "approximate", "prefix_hash", "session", "least_loaded", "round_robin", "random")


def validate_engine_url(url: str) -> str:
    """Return ``url`` if the router can talk HTTP to it, else raise ValueError saying why.

    Engine URLs arrive from the config, the admin API and the replicated registry; the pool builds the
    Host header from the authority, so anything that is not plain ASCII (or carries userinfo) would
    fail later, inside a background task, instead of here.
    """
    if not isinstance(url, str):
        raise ValueError(f"expected an http(s) URL, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"expected an http(s) URL, got {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL, got {url!r}")
    if not url.isascii() or any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"expected an http(s) URL of printable ASCII (punycode for IDN hosts), got {url!r}")
    if "@" in parts.netloc:
        raise ValueError(f"expected an http(s) URL without user:password@, got {url!r}")
    if port is not None and port < 1:
        raise ValueError(f"expected an http(s) URL with a port in 1..65535, got {url!r}")
    return url


MAX_LABEL_CHARS = 64


def check_engine_label(key: str, value: Any) -> None:
    """ValueError unless ``value`` is null or a printable string of 1-64 characters: the one rule for an
    engine's island and zone, wherever they come from (the config file, the admin API, a provider, a peer's
    replicated entry), so a label one replica accepts is never refused by the others."""
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_LABEL_CHARS
                                  and value.isprintable()):
        raise ValueError(f"'{key}' must be null or a printable string of up to {MAX_LABEL_CHARS} characters")


@dataclass
class EngineConfig:
    url: str
    model: str | None = None
    id: str | None = None
    events: str | None = None
    replay: str | None = None
    topic: str = "kv"
    island: str | None = None
    block_size: int | None = None
    curve_server_key: str | None = None
    """The event publisher's CURVE public key (Z85): its events are read over CURVE (events/curve.py)."""
    role: str | None = None
    """prefill | decode | both (gateway/disaggregation/roles.py); unset: as the engine reports it (vLLM's
    development /server_info), else both."""
    kv_protocol: str | None = None
    """How its KV cache is handed over in a prefill/decode pair: handoff | opaque; unset: as the engine's
    connector says (/server_info), else handoff."""
    tiers: TierConfig = field(default_factory=TierConfig)
    """What a hit in the engine's offloaded CPU/storage tiers costs (gateway/tier_config.py)."""

    def validate(self, where: str) -> None:
        try:
            validate_engine_url(self.url)
        except ValueError as exc:
            raise ConfigError(f"{where}.url: {exc}") from None
        if self.curve_server_key is not None:
            try:
                check_z85_key(self.curve_server_key, f"{where}.curve_server_key")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        try:
            check_topic(self.topic)
        except ValueError as exc:
            raise ConfigError(f"{where}.topic: {exc}") from None
        for key in ("events", "replay"):
            value = getattr(self, key)
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"{where}.{key}: expected a tcp:// or ipc:// ZeroMQ endpoint, got {value!r}")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"{where}.block_size: must be positive")
        for key, check in (("island", check_engine_label), ("role", check_role), ("kv_protocol", check_protocol)):
            try:
                check(key, getattr(self, key))
            except ValueError as exc:
                raise ConfigError(f"{where}.{key}: {exc}") from None
        self.tiers.validate(f"{where}.tiers")


@dataclass
class MeshConfig:
    bind: str | None = None
    advertise: str | None = None
    seeds: list[str] = field(default_factory=list)
    secret_file: str | None = None
    replication_bind: str | None = None
    redis_url: str | None = None
    cluster: str = "kvmesh"


@dataclass
class TracingConfig:
    exporter: str = "none"
    endpoint: str | None = None
    service_name: str = "kvmesh-router"

    def validate(self) -> None:
        if self.exporter not in ("none", "console", "otlp"):
            raise ConfigError(f"tracing.exporter: {self.exporter!r} is not none | console | otlp")


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv_aware"
    tokenizer: str | None = None
    tokenizers: dict[str, str] = field(default_factory=dict)
    tokenizer_workers: int = field(default_factory=default_workers)
    """Processes that encode very long prompts (half the machine's cores, 1-4, unless set)."""
    island: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 120.0
    idle_timeout_s: float = 120.0
    shutdown_grace_s: float = 30.0
    """On SIGTERM: how long requests in flight may run on; streams still running then end with an SSE error."""
    metrics_interval_s: float = 1.0
    events_curve_secret_file: str | None = None
    """The router's CURVE secret key (Z85), for engines whose events need CURVE (curve_server_key)."""
    ingest_process: bool = False
    """Ingest KV events in a child process (gateway/process_ingest.py): the serving loop then only applies index
    updates, and a replica uses a second core for its fleet's events."""
    log_level: str = "info"
    engines: list[EngineConfig] = field(default_factory=list)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tenants: list[TenantConfig] = field(default_factory=list)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    autoscaler: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    pd: PdConfig = field(default_factory=PdConfig)
    adapter_load_s: float = 0.01
    """What loading a LoRA adapter into an engine's slot costs a request (gateway/adapters.py): a rank-16
    adapter of an 8B model is ~40 MB, a few ms from host memory into a GPU slot, more from disk."""
    engine_priority: EnginePriorityConfig = field(default_factory=EnginePriorityConfig)
    """Priority classes sent to the engines as vLLM's ``priority`` (gateway/engine_priority.py)."""
    multimodal: dict[str, MultimodalModelConfig] = field(default_factory=dict)
    """Per served model: the placeholder token and tokens per image/audio item (gateway/media_config.py)."""

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: {self.port} is not a TCP port")
        for key in ("max_body_bytes", "max_attempts", "tokenizer_workers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be at least 1")
        for key in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "shutdown_grace_s",
                    "metrics_interval_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be positive")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level: {self.log_level!r} is not debug|info|warning|error")
        seen: set[str] = set()
        for i, engine in enumerate(self.engines):
            engine.validate(f"engines[{i}]")
            if engine.url in seen:
                raise ConfigError(f"engines[{i}].url: {engine.url} is listed twice")
            seen.add(engine.url)
        if self.events_curve_secret_file is not None:
            try:
                CurveClient.load(self.events_curve_secret_file)
            except ValueError as exc:
                raise ConfigError(f"events_curve_secret_file: {exc}") from None
        elif any(engine.curve_server_key for engine in self.engines):
            raise ConfigError("events_curve_secret_file: engines with a curve_server_key need the router's "
                              "CURVE secret key (kvmesh keys curve makes a pair)")
        validate_security(self.auth, self.tenants)
        self.auth.check_exposure(self.host)
        self.admission.validate("admission")
        self.engine_priority.validate("engine_priority")
        for model, media in self.multimodal.items():
            media.validate(f"multimodal.{model}")
        if not 0 <= self.adapter_load_s <= 60:
            raise ConfigError("adapter_load_s: must be between 0 and 60 seconds")
        self.tracing.validate()
        self.limits.validate("limits")
        self.pd.validate("pd")
        try:
            self.autoscaler.validate()  # the autoscaler's own rules name the key; this makes them a ConfigError
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a TOML or environment value to the annotated type, or say which key is wrong."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(value, inner[0], where)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table")
        return _build(hint, value, where)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table")
        return {str(k): _coerce(v, typing.get_args(hint)[1], f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported setting")


def _build(cls: type, table: dict[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        path = f"{where}.{key}" if where else key
        if key not in known:
            raise ConfigError(f"{path}: unknown key")
        kwargs[key] = _coerce(value, hints[key], path)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs]
        raise ConfigError(f"{where or 'config'}: missing {', '.join(missing)} ({exc})") from None


def _engines_from_urls(urls: list[str]) -> list[dict[str, Any]]:
    return [{"url": url} for url in urls]


def env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``KVMESH_PORT=8001`` sets ``port``; ``KVMESH_MESH__BIND`` sets ``mesh.bind``; ``KVMESH_ENGINES`` a URL list."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith("KVMESH_"):
            continue
        path = name[len("KVMESH_") :].lower().split("__")
        if path == ["engines"]:
            out["engines"] = _engines_from_urls([v.strip() for v in value.split(",") if v.strip()])
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "tokenizers":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    cli: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    extra_engines: list[str] | None = None,
) -> RouterConfig:
    """File, then environment, then CLI; engines given as URLs are added to the file's list."""
    table: dict[str, Any] = {}
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    table = _merge(table, env_overrides(dict(os.environ if environ is None else environ)))
    table = _merge(table, {k: v for k, v in (cli or {}).items() if v is not None})
    config = _build(RouterConfig, table)
    known = {e.url.rstrip("/") for e in config.engines}
    for url in extra_engines or []:
        if url.rstrip("/") not in known:
            config.engines.append(_build(EngineConfig, {"url": url}, f"engines[{len(config.engines)}]"))
            known.add(url.rstrip("/"))
    config.validate()
    return config
