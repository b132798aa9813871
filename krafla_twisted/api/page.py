"""The chat page: `GET /` answers krafla_twisted/api/web/index.html, `GET /ui/NAME` its script and styles.

The files are read once, when the route table is built, into a table keyed by file name; a request
names one of them or gets the API's 404. No request path reaches the file system, so there is no
directory listing and no way out of web/ (`..`, `%2f`, absolute paths are names like any other).

Every file goes out with a strict Content-Security-Policy (scripts, styles and fetches from this
origin only, no inline code, no frames), `nosniff`, an ETag, and `Cache-Control: no-cache`: a
browser keeps the files but asks again each time (a 304 when unchanged), so an upgraded server's
page is seen at once. The page needs no API key (a browser's navigation cannot send one); the page
asks for the key and sends it with its own calls. This runs in the I/O thread.
"""

import hashlib
import os

from krafla_twisted.api.resources import APIResource, Group, NotFoundResource

WEB_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web")
PAGE_FILES = ("index.html", "style.css", "app.js", "markdown.js")  # what web/ ships: setup.py's package_data
CONTENT_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    b"object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class PageFile:
    """One file of the page: its bytes, Content-Type and ETag (a quoted hash of the bytes)."""

    def __init__(self, name, body):
        self.name = name
        self.body = body
        self.content_type = CONTENT_TYPES[os.path.splitext(name)[1]]
        self.etag = b'"' + hashlib.sha256(body).hexdigest()[:32].encode("ascii") + b'"'


def load_page_files(directory=WEB_DIRECTORY):
    """{name: PageFile} for every file of PAGE_FILES in `directory`; a missing one is a FileNotFoundError
    naming it (the package was installed without its data files)."""
    files = {}
    for name in PAGE_FILES:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as handle:
                files[name] = PageFile(name, handle.read())
        except FileNotFoundError:
            raise FileNotFoundError(f"the chat page's file {path} is missing: reinstall krafla "
                                    f"(setup.py's package_data ships krafla_twisted/api/web/)") from None
    return files


def serve_file(request, page_file):
    """The body of `page_file` with its headers, or an empty 304 when the browser's copy is current."""
    request.setHeader(b"content-type", page_file.content_type)
    request.setHeader(b"cache-control", b"no-cache")
    request.setHeader(b"etag", page_file.etag)
    request.setHeader(b"content-security-policy", CONTENT_SECURITY_POLICY)
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"referrer-policy", b"no-referrer")
    known = request.getHeader(b"if-none-match")
    if known is not None and page_file.etag in (tag.strip() for tag in known.split(b",")):
        request.setResponseCode(304)
        return b""
    return page_file.body


class PageFileResource(APIResource):
    """One file of the page, at `/` (index.html) or `/ui/NAME`; any path below it is the API's 404,
    after the key check like every unknown path."""

    isLeaf = True
    methods = ("GET",)
    needs_key = False

    def __init__(self, api, page_file):
        super().__init__(api)
        self.page_file = page_file

    def render(self, request):
        if request.postpath:
            return NotFoundResource(self.api).render(request)
        return super().render(request)

    def render_GET(self, request):
        return serve_file(request, self.page_file)


def add_chat_page(root, api, files=None):
    """Put the page at `/` and its script and styles at `/ui/NAME` of `root` (the route table's root)."""
    files = load_page_files() if files is None else files
    root.putChild(b"", PageFileResource(api, files["index.html"]))
    assets = Group(api)  # /ui itself is a 404: no listing
    for name, page_file in files.items():
        if name != "index.html":
            assets.putChild(name.encode("ascii"), PageFileResource(api, page_file))
    root.putChild(b"ui", assets)
