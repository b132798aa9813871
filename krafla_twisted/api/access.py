"""Who may call: the API key (Authorization: Bearer KEY) and the browser origins allowed by --cors."""

import hmac

from krafla_twisted.api.errors import Unauthorized

CORS_METHODS = b"GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = b"Authorization, Content-Type"
CORS_MAX_AGE = b"600"


class Access:
    """The access policy: `api_key` (str or None) and `cors_origins` (a tuple; "*" means any)."""

    def __init__(self, api_key=None, cors_origins=()):
        self._key = api_key.encode("utf-8") if api_key else None
        self.cors_origins = tuple(cors_origins)

    @property
    def needs_key(self):
        return self._key is not None

    def check_key(self, request):
        """Raise Unauthorized unless the request carries the key. The comparison takes constant time."""
        if self._key is None:
            return
        headers = request.requestHeaders.getRawHeaders(b"authorization")
        if not headers:
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
