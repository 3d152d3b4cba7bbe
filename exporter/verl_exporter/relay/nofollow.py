"""The one HTTP opener of the relay's outgoing requests (robots, control endpoints): it never follows a
redirect."""

from __future__ import annotations

import urllib.request
from email.message import Message
from typing import IO


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is an answer, not an instruction: following it would hand the request (and, for the control
    endpoint, its bearer token) to another address, and count that address's answer as the target's."""

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Message,
                         newurl: str) -> None:
        return None  # urllib then raises HTTPError(3xx)


OPENER = urllib.request.build_opener(_NoRedirect)
