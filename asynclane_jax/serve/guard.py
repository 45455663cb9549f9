"""What a request must pass before the app reads it: the server's own Host and Origin,
the API key, a JSON content type and a bounded body.

  Host       the name a request reached the server by: loopback names, the address it
             listens on (for 0.0.0.0 / ::, also the machine's names and any IP address),
             or one of `allowed_hosts`; another name (DNS rebinding: a web page's own
             domain resolved to this machine) is a 403.
  Origin     absent (curl, SDKs), the server's own (same host and port as Host), or one
             of `allowed_origins` (which also get CORS headers); another origin (a web
             page the user opened) is a 403.
  API key    with `api_key` set, every path but /health needs `Authorization: Bearer
             <key>` (compared in constant time); else a 401.
  POST       `Content-Type: application/json` (else 415); a body of at most
             `max_body_bytes`, read with that bound (a Content-Length above it is refused
             before any byte is read; 413) and within `body_timeout` seconds (408).

Every refusal is OpenAI's error body. The checks are a pure ASGI middleware, so that a
streamed response passes through untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from asynclane_jax.serve.protocol import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
DEFAULT_MAX_BODY_BYTES = 1 << 20
UNAUTHENTICATED_PATHS = ("/health",)


def is_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this machine only."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                                   for i in infos)


def own_hosts(bind: str) -> tuple[tuple[str, ...], bool]:
    """The host names a server listening on `bind` answers to, and whether any IP
    address is one of them (a wildcard bind)."""
    names = list(LOOPBACK_NAMES)
    wildcard = bind in WILDCARD_HOSTS
    if wildcard:
        for name in (socket.gethostname(), socket.getfqdn()):
            if name:
                names.append(name)
    else:
        names.append(bind)
    return tuple(dict.fromkeys(_norm_host(n) for n in names)), wildcard


def _norm_host(host: str) -> str:
    return host.strip().lower().rstrip(".").strip("[]")


def _split_authority(value: str) -> tuple[str, str | None]:
    """'Host:port' -> (host, port); IPv6 in brackets."""
    value = value.strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return _norm_host(host), rest[1:] if rest.startswith(":") else None
    if value.count(":") == 1:
        host, port = value.split(":")
        return _norm_host(host), port
    return _norm_host(value), None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Security:
    """The checks of `Guard` (the default: no key, loopback names only, 1 MiB bodies).

    Attributes:
      api_key: the key every request but /health must bear (None: none needed).
      hosts: the server's own host names (`own_hosts` of the address it listens on).
      any_ip_host: any IP address is an own host name (a wildcard bind).
      allowed_hosts: further Host names accepted ("*": any).
      allowed_origins: further browser origins accepted, e.g. "https://app.example"
        ("*": any); they get CORS headers.
      max_body_bytes: the largest request body.
      body_timeout: seconds to receive a body in.
    """

    api_key: str | None = None
    hosts: tuple[str, ...] = LOOPBACK_NAMES
    any_ip_host: bool = False
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = 30.0

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: must be at least 1")
        object.__setattr__(self, "hosts", tuple(_norm_host(h) for h in self.hosts))
        object.__setattr__(self, "allowed_hosts",
                           tuple(_norm_host(h) for h in self.allowed_hosts))
        object.__setattr__(self, "allowed_origins",
                           tuple(o.strip().lower().rstrip("/") for o in self.allowed_origins))

    def host_ok(self, host: str) -> bool:
        return (host in self.hosts or "*" in self.allowed_hosts or host in self.allowed_hosts
                or (self.any_ip_host and _is_ip(host)))

    def origin_ok(self, origin: str, host_header: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (a sandboxed frame, a file) and the like
        host, port = _split_authority(parts.netloc)
        want_host, want_port = _split_authority(host_header)
        default = "443" if parts.scheme == "https" else "80"
        return (host == want_host and (port or default) == (want_port or default)
                and self.host_ok(host))


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str, headers=None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = headers or {}


async def _send_error(send, err: _Refused) -> None:
    from starlette.responses import JSONResponse

    typ = "authentication_error" if err.status == 401 else "invalid_request_error"
    resp = JSONResponse(error_body(err.message, type=typ, code=err.code),
                        status_code=err.status, headers=err.headers)
    await resp({"type": "http"}, _no_receive, send)


async def _no_receive():  # pragma: no cover - a JSONResponse does not read
    return {"type": "http.disconnect"}


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class HostGate:
    """The outer check: Host and Origin (before CORS and everything else)."""

    def __init__(self, app, security: Security):
        self.app, self.security = app, security

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self.check(scope)
        except _Refused as err:
            return await _send_error(send, err)
        return await self.app(scope, receive, send)

    def check(self, scope) -> None:
        raw = _header(scope, b"host")
        if raw is None:
            raise _Refused(403, "the Host header is missing", "host_not_allowed")
        host_header = raw.decode("latin-1")
        host, _ = _split_authority(host_header)
        if not self.security.host_ok(host):
            raise _Refused(403, f"Host {host_header[:100]!r} is not this server's name; the "
                                "operator may allow it (asynclane-jax serve --allowed-hosts)",
                           "host_not_allowed")
        origin = _header(scope, b"origin")
        if origin is not None and not self.security.origin_ok(origin.decode("latin-1"),
                                                              host_header):
            raise _Refused(403, f"Origin {origin.decode('latin-1')[:100]!r} is not allowed; the "
                                "operator may allow it (asynclane-jax serve "
                                "--allowed-origins)", "origin_not_allowed")


class Guard:
    """The inner check: the API key, the content type and the bounded body."""

    def __init__(self, app, security: Security):
        self.app, self.security = app, security
        key = security.api_key
        self._want = None if key is None else b"bearer " + key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            if scope["method"] != "OPTIONS":
                self.authorize(scope)
            if scope["method"] == "POST":
                receive = await self.body(scope, receive)
        except _Refused as err:
            return await _send_error(send, err)
        return await self.app(scope, receive, send)

    def authorize(self, scope) -> None:
        if self._want is None or scope["path"] in UNAUTHENTICATED_PATHS:
            return
        given = _header(scope, b"authorization") or b""
        # The scheme is case-insensitive; the key is compared in constant time.
        given = given[:7].lower() + given[7:]
        if not hmac.compare_digest(given, self._want):
            why = "is missing" if not given else "is not valid"
            raise _Refused(401, f"the API key {why}: send Authorization: Bearer <key>",
                           "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def body(self, scope, receive):
        ctype = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            raise _Refused(415, "send the request body as JSON, with Content-Type: "
                                "application/json", "unsupported_media_type")
        limit = self.security.max_body_bytes
        too_large = _Refused(413, f"the request body is larger than this server takes "
                                  f"({limit} bytes)", "request_too_large")
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise too_large
            except ValueError:
                raise _Refused(400, "the Content-Length header is not a number",
                               "invalid_request") from None

        async def read() -> bytes:
            parts, n = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Refused(400, "the client went away", "client_disconnected")
                chunk = message.get("body", b"")
                n += len(chunk)
                if n > limit:
                    raise too_large
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts)

        try:
            body = await asyncio.wait_for(read(), self.security.body_timeout)
        except asyncio.TimeoutError:
            raise _Refused(408, f"the request body did not arrive within "
                                f"{self.security.body_timeout:g} s", "request_timeout") from None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay
