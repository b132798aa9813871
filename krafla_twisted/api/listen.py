"""`--listen`: where the server listens, as Twisted endpoint strings.

    --listen tcp:8080:interface=127.0.0.1
    --listen tcp6:8080:interface=\\:\\:1
    --listen unix:/run/krafla/krafla.sock:mode=660
    --listen ssl:8443:privateKey=key.pem:certKey=cert.pem:interface=0.0.0.0

The option may be given more than once (one socket each); without it the server listens on
--host/--port. Any string twisted.internet.endpoints.serverFromString accepts works (systemd: too);
the strings are parsed when the options are, so a missing certificate is an option error.
"""

import ipaddress

from twisted.internet import endpoints
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress


def check_description(description):
    """Parse `description` once (no socket is opened); ValueError with the reason when it is wrong."""
    if not description.strip():
        raise ValueError("--listen takes a Twisted endpoint string such as tcp:8080 or unix:/run/krafla.sock")
    try:
        # The reactor is only stored by the endpoint; ssl: reads its key and certificate here.
        return endpoints.serverFromString(None, description)
    except Exception as e:  # serverFromString raises ValueError, KeyError, TypeError, OSError, SSL errors
        raise ValueError(f"--listen {description!r}: {e}") from None


def make_endpoint(reactor, description):
    return endpoints.serverFromString(reactor, description)


def is_tls(endpoint):
    return isinstance(endpoint, endpoints.SSL4ServerEndpoint)


def listening_line(endpoint, port):
    """The start-up line for one listening port: `# listening on http(s)://HOST:PORT/v1`, or for a
    unix socket `# listening on unix:PATH (http://localhost/v1)`."""
    address = port.getHost()
    scheme = "https" if is_tls(endpoint) else "http"
    if isinstance(address, UNIXAddress):
        name = address.name.decode("utf-8", "replace") if isinstance(address.name, bytes) else address.name
        return f"# listening on unix:{name} ({scheme}://localhost/v1)"
    if isinstance(address, (IPv4Address, IPv6Address)):
        host = f"[{address.host}]" if ":" in address.host else address.host
        return f"# listening on {scheme}://{host}:{address.port}/v1"
    return f"# listening on {address}"


def reaches_beyond_this_machine(port):
    """True when `port` accepts connections from other machines (an IP socket not on loopback)."""
    address = port.getHost()
    if not isinstance(address, (IPv4Address, IPv6Address)):
        return False
    try:
        return not ipaddress.ip_address(address.host.split("%")[0]).is_loopback
    except ValueError:
        return True
