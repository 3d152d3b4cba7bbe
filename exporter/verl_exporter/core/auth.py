"""The one bearer-token check, shared by the sidecar's /control endpoint and the relay's webhook.

RFC 6750 section 2.1: ``Authorization: Bearer <token>``. The scheme is case-insensitive (RFC 9110 section
11.1: "bearer" and "BEARER" are the same scheme) and is followed by one or more spaces; the token itself is
compared exactly, in constant time (hmac.compare_digest), so that the answer's timing does not tell how
much of a guess was right.
"""

from __future__ import annotations

import hmac

SCHEME = "bearer"


def bearer_token_ok(header: str | None, token: str) -> bool:
    """True when an Authorization header value carries exactly this bearer token."""
    scheme, _, credentials = (header or "").strip(" \t").partition(" ")
    if scheme.lower() != SCHEME or not token:
        return False
    # WSGI gives header values as latin-1 decoded str: encoding back gives the bytes as sent.
    given = credentials.strip(" \t").encode("latin-1", "replace")
    return hmac.compare_digest(given, token.encode("utf-8"))
