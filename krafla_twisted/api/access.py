"""Who may call: the API key (Authorization: Bearer KEY, or x-api-key: KEY), the browser origins
allowed by --cors, and (without a key) the Host names a request may be addressed to, against DNS
rebinding."""

import hmac
import ipaddress

from krafla_twisted.api.errors import HostNotAllowed, Unauthorized

CORS_METHODS = b"GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = b"Authorization, Content-Type"
CORS_MAX_AGE = b"600"


class Access:
    """The access policy: `api_key` (str or None), `cors_origins` (a tuple; "*" means any) and
    `allowed_hosts` (extra Host names accepted without a key; "*" means any)."""

    def __init__(self, api_key=None, cors_origins=(), allowed_hosts=()):
        self._key = api_key.encode("utf-8") if api_key else None
        self.cors_origins = tuple(cors_origins)
        self.allowed_hosts = frozenset(_normal_host(h) for h in allowed_hosts)

    def check_host(self, request):
        """Without an API key, refuse requests addressed to a DNS name (other than localhost).

        DNS rebinding: a web page at evil.example re-points its own name at 127.0.0.1, and the browser
        then sends the page's requests here as same-origin, so CORS does not stop it reading replies.
        Such requests carry `Host: evil.example`. An IP address, localhost or a single-label name
        cannot be re-pointed by a page's author, so they pass; other names need --allow-host. With a
        key the page cannot authenticate anyway.
        """
        if self._key is not None or "*" in self.allowed_hosts:
            return
        for value in request.requestHeaders.getRawHeaders(b"host") or ():
            name = _normal_host(value.decode("latin-1"))
            if not _host_is_local(name) and name not in self.allowed_hosts:
                raise HostNotAllowed(name)

    @property
    def needs_key(self):
        return self._key is not None

    def check_key(self, request):
        """Raise Unauthorized unless the request carries the key. The comparison takes constant time."""
        if self._key is None:
            return
        headers = request.requestHeaders.getRawHeaders(b"authorization")
        if not headers:
            # Anthropic's clients send the key as `x-api-key: KEY` (read only without Authorization).
            keys = request.requestHeaders.getRawHeaders(b"x-api-key")
            if keys and len(keys) == 1 and hmac.compare_digest(keys[0].strip(), self._key):
                return
            if keys:
                raise Unauthorized("Incorrect API key provided" if len(keys) == 1 else "Send one x-api-key header, not several")
            raise Unauthorized("You didn't provide an API key: send the header 'Authorization: Bearer KEY'")
        if len(headers) > 1:
            # A proxy and this server could each read a different one: refuse rather than pick.
            raise Unauthorized("Send one Authorization header, not several")
        header = headers[0]
        scheme, _, token = header.strip().partition(b" ")
        # compare_digest on the whole token: its time does not depend on where the first difference is.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            raise Unauthorized("Incorrect API key provided")

    def allowed_origin(self, request):
        """The value for Access-Control-Allow-Origin, or None when the origin may not read replies."""
        origin = request.getHeader(b"origin")
        if origin is None or not self.cors_origins:
            return None
        if "*" in self.cors_origins:
            return b"*"
        text = origin.decode("latin-1")
        return origin if text in self.cors_origins else None

    def add_cors_headers(self, request):
        if not self.cors_origins:
            return
        request.setHeader(b"vary", b"Origin")
        origin = self.allowed_origin(request)
        if origin is not None:
            request.setHeader(b"access-control-allow-origin", origin)

    def preflight(self, request):
        """Answer an OPTIONS request: 204, with the CORS grant when the origin is allowed."""
        request.setResponseCode(204)
        request.setHeader(b"allow", CORS_METHODS)
        if self.allowed_origin(request) is not None:
            asked = request.getHeader(b"access-control-request-headers")
            request.setHeader(b"access-control-allow-methods", CORS_METHODS)
            request.setHeader(b"access-control-allow-headers", asked or CORS_DEFAULT_HEADERS)
            request.setHeader(b"access-control-max-age", CORS_MAX_AGE)
        return b""


def _normal_host(value):
    """The host name of a Host header value or --allow-host entry: no port, no brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    name, colon, port = value.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def _host_is_local(name):
    if not name or "." not in name and ":" not in name:
        return True  # no Host, or a single label (resolved locally, never through public DNS)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
